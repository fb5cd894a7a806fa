"""OCI images from image locks (:mod:`trainer.lock`), bit for bit.

The content-addressed input cache (``cas``, its CLI ``cachecli``: ``trainer cache``), the bases (``base``: a
registry image seeded into the cache; ``debian``: a root file system from pinned .debs), deterministic layers
(``layer``, reading tars: ``tarread``), wheel installation (``wheels``), git sources (``sources``, tree ids without
git: ``gittree``; the smoke image's source: ``smoke``), compiled parts built like derivations (``native``, in the
build root: ``buildroot``), the build (``build``), layouts and archives (``oci``), comparison (``diff``), SBOMs
(``sbom``), provenance (``provenance``) attached as OCI referrers (``referrers``), and ``trainer image`` (``cli``).
"""
