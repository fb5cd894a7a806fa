"""A hermetic reproducibility bundle for large-scale LLM training recipes.

One package per phase of a run: :mod:`trainer.compose` (compose with Hydra, type, check, render the miles
launch, plan) -> :mod:`trainer.data` (the fixed training rows) -> :mod:`trainer.image` (the OCI image from an
image lock) -> :mod:`trainer.launch` (the launchers, ``launch.host``, and what runs inside the job) ->
:mod:`trainer.record` (the run directory and what it says) -> :mod:`trainer.report` (throughput, MFU, cost,
convergence). ``python -m trainer.train`` (``train``) tells the story of a run; ``python -m trainer``
(``trainer``) is the rest of the command line.
"""

from pathlib import Path

__version__ = "0.1.0"
PROJECT = "recipe-bundle"
# The source tree (conf/, lockfiles/ and the package); absolute() keeps Bazel runfiles paths unresolved.
REPO_ROOT = Path(__file__).absolute().parent.parent
# The bundle's home: builder.id of its provenance, the namespace of its SBOMs and predicate types
PROJECT_URL = "https://github.com/recipe-bundle/recipe-bundle"
