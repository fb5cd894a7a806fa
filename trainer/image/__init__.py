"""OCI images from lockfiles, bit for bit: lock format (``lockfile``), content-addressed cache (``cas``),
deterministic layers (``layer``), wheel installation (``wheels``), git sources (``sources``), the build
(``build``), layouts and archives (``oci``), comparison (``diff``) and the ``trainer image|lock|cache`` CLIs."""
