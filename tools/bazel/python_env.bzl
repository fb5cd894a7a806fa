"""The locked launcher Python as a registered Bazel toolchain.

`locked_python` runs bin/python-env, which builds (once, hash-checked from lockfiles/launcher.lock) or
finds the launcher environment, and declares a py_runtime whose interpreter is that environment's
python. Every py_test then runs under the locked interpreter, also with --incompatible_strict_action_env.
The rule is re-run when bin/python-env or the lock changes.
"""

_BUILD = """\
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")

py_runtime(
    name = "py3",
    interpreter_path = "{python}",
    python_version = "PY3",
    stub_shebang = "#!{python}",
)

py_runtime_pair(name = "pair", py3_runtime = ":py3")

toolchain(
    name = "toolchain",
    toolchain = ":pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)
"""

def _locked_python_impl(rctx):
    script = rctx.path(Label("//:bin/python-env"))
    rctx.path(Label("//:lockfiles/launcher.lock"))  # re-run when the lock changes
    result = rctx.execute([str(script)], timeout = 1800, quiet = False)
    if result.return_code != 0:
        fail("bin/python-env failed (exit %d): %s" % (result.return_code, result.stderr.strip().split("\n")[-1]))
    python = result.stdout.strip()
    rctx.file("BUILD.bazel", _BUILD.format(python = python))

locked_python = repository_rule(
    implementation = _locked_python_impl,
    environ = ["HOME", "XDG_CACHE_HOME", "TRAINER_ENV_ROOT", "TRAINER_PYTHON"],
    local = True,
)
