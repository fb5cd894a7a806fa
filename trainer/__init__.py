"""A hermetic reproducibility bundle for large-scale LLM training recipes.

The package follows the phases of a run: compose (``trainer.schema`` + ``conf/``) → check
(``trainer.checks``) → render the launch (``trainer.render``) → plan (``trainer.plan``) →
record (``trainer.record``). ``python -m trainer.train`` is the Hydra entry point.
"""

from pathlib import Path

__version__ = "0.1.0"
PROJECT = "recipe-bundle"
# The source tree (conf/, lockfiles/ and the package); absolute() keeps Bazel runfiles paths unresolved.
REPO_ROOT = Path(__file__).absolute().parent.parent
# The bundle's home: builder.id of its provenance, the namespace of its SBOMs and predicate types
PROJECT_URL = "https://github.com/recipe-bundle/recipe-bundle"
