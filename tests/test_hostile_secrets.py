"""Hostile secrets: redaction by rule, not by pattern luck (issue #25, points 1 and 2).

A secret in any form (URL user info holding ``: ( ) ' @``, a short password, a lower- or mixed-case name, a secret CLI
flag or HTTP header inside a list, a ``$``-leading, long, multi-line value, a URL fragment, ``NAME=VALUE`` in a list,
an inherited ``CUSTOM_HEADERS`` JSON, ``SSHPASS``), typed in any override syntax (plain, quoted, ``+``, ``++``, list
element, Hydra-escaped), must appear in no serialisation the bundle or Hydra makes of it (Hydra's stored override,
YAML, JSON, the shell's quoting, Python's repr in error lines), in no file of a run directory (raw bytes and the
base64 payload of a signed attestation), and in nothing ``train`` prints. The big matrix runs the redactor and the
serialisers in this process; a smaller one runs ``python -m trainer.train`` (``launcher=plan``), a signed failing
run and the refusals end to end.
"""

import base64
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

import helpers
from helpers import run_train
from trainer.compose.commandline import quote_override_value
from trainer.compose.render import shell_word
from trainer.record.rundir import CHUNK_BYTES, scrub_file, sweep
from trainer.redact import (
    REDACTED,
    RedactingStream,
    Redactor,
    is_secret_name,
    redact_argv,
    redact_error,
    redact_field,
    redacted_streams,
)

# ------------------------------------------------------------------------------------------ the forms

# name -> (key, value, canary): a value that is secret because of its key (secret-named) or because of its form
FORMS = {
    "url password with :": ("paths.ref_load", "https://u:pa:ss:cnrUrlColon1@host/x", "cnrUrlColon1"),
    "url password with ()": ("paths.ref_load", "https://u:p(cnrUrlParen2)w@host/x", "cnrUrlParen2"),
    "url password with '": ("paths.ref_load", "https://u:pa'cnrUrlQuote3@host/x", "cnrUrlQuote3"),
    "url password with @": ("paths.ref_load", "https://u:p@cnrUrlAt4@host/x", "cnrUrlAt4"),
    "short url password": ("paths.ref_load", "https://u:s7Cpw@host/x", "s7Cpw"),
    "lower-case name": ("env.hf_token", "cnrLower5x", "cnrLower5x"),
    "mixed-case name": ("env.HfToken", "cnrMixed6x", "cnrMixed6x"),
    "short value of a lower-case name": ("env.hf_token", "lc7abcd", "lc7abcd"),
    "flag=value in a job list": ("launcher.job", ["x", "--hf-token=cnrFlag7xy"], "cnrFlag7xy"),
    "flag value as the next element": ("launcher.job", ["x", "--api-key", "cnrFlag8xy"], "cnrFlag8xy"),
    "password flag": ("launcher.job", ["x", "--password=cnrFlag9xy"], "cnrFlag9xy"),
    "redis password in ray_start_args": ("launcher.ray_start_args", ["--redis-password=cnrRedis10"], "cnrRedis10"),
    "authorization header": ("launcher.job", ["curl", "-H", "Authorization: Bearer cnrBearer11"], "cnrBearer11"),
    "api-key header": ("launcher.job", ["curl", "-H", "Api-Key: cnrApiKey12"], "cnrApiKey12"),
    "x-api-key header": ("launcher.job", ["curl", "-H", "X-Api-Key: cnrXApi13"], "cnrXApi13"),
    "dollar-leading value": ("env.X_KEY", "$cnrDollar14", "cnrDollar14"),
    "long value with spaces": (
        "env.LONG_SECRET",
        " ".join(["word"] * 20 + ["cnrLong15x"] + ["tail"] * 10),
        "cnrLong15x",
    ),
    "value with a newline": ("env.NL_SECRET", "first line\ncnrNewline16 second", "cnrNewline16"),
    "url fragment token": ("paths.ref_load", "https://host/x#access_token=cnrFrag17", "cnrFrag17"),
    "NAME=VALUE in a list": ("launcher.job", ["x", "HF_TOKEN=cnrAssign18"], "cnrAssign18"),
}


def hydra_text(value) -> str:
    """``value`` as a Hydra override value: each string single-quoted (:func:`quote_override_value`)."""
    if isinstance(value, list):
        return "[" + ",".join(hydra_text(v) for v in value) + "]"
    return quote_override_value(value)


def escaped_text(value) -> str:
    """``value`` written with Hydra's backslash escapes instead of quotes, as Hydra itself stores it."""
    from hydra._internal.grammar.utils import escape_special_characters

    if isinstance(value, list):
        return "[" + ",".join(escaped_text(v) for v in value) + "]"
    return escape_special_characters(value)


def plain_text(value) -> str:
    return "[" + ",".join(value) + "]" if isinstance(value, list) else value


SYNTAXES = {
    "plain": lambda key, value: f"{key}={plain_text(value)}",
    "quoted": lambda key, value: f"{key}={hydra_text(value)}",
    "double-quoted": lambda key, value: f'{key}="{plain_text(value)}"' if '"' not in str(value) else None,
    "+": lambda key, value: f"+{key}={hydra_text(value)}",
    "++": lambda key, value: f"++{key}={hydra_text(value)}",
    "list element": lambda key, value: f"{key}=[{hydra_text(value)}]" if isinstance(value, str) else None,
    "escaped": lambda key, value: f"{key}={escaped_text(value)}",
}


def serialisations(override: str):
    """Every text the bundle or Hydra makes of an override: Hydra's stored override (overrides.yaml, hydra.yaml,
    override_dirname, "Error executing job with overrides" repr), YAML and JSON of its value (config.yaml,
    record.json, argv.json), the shell's quoting (command.sh, sbatch.sh), Python's repr (error lines)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_override(override)
    key, value = parsed.key_or_group, parsed.value()
    stored = f"{override[: len(override) - len(override.lstrip('+'))]}{key}={parsed.get_value_element_as_str()}"
    strings = value if isinstance(value, list) else [value]
    out = {
        "typed": override,
        "hydra stored": stored,
        "hydra yaml list": yaml.safe_dump([stored]),
        "override_dirname": f"a=1,{stored},z=2",
        "repr of overrides": repr([stored]),
        "config.yaml": OmegaConf.to_yaml(OmegaConf.create({key.rsplit(".", 1)[-1]: value})),
        "yaml block": yaml.safe_dump({"env": {key.rsplit(".", 1)[-1]: value}}, width=40),
        "json": json.dumps({key: value}, indent=2),
        "json ascii": json.dumps({key: value}, ensure_ascii=True),
        "json in json": json.dumps({"env": json.dumps({key: value})}),
        "argv.json": json.dumps(["--x", *strings], indent=2),
        "shell": " ".join(shell_word(str(s)) for s in strings),
        "shlex": " ".join(shlex.quote(str(s)) for s in strings),
        "export": f"export {key.rsplit('.', 1)[-1]}={shlex.quote(str(strings[0]))}",
        "repr": repr(value),
        "error": f"Cannot convert 'list' to string: '{value!r}'",
    }
    return value, out


CASES = [
    (form, syntax) for form in sorted(FORMS) for syntax in SYNTAXES if SYNTAXES[syntax](*FORMS[form][:2]) is not None
]


@pytest.mark.parametrize("form,syntax", CASES)
def test_a_secret_leaves_no_trace_in_any_serialisation(form, syntax):
    """Promise: whatever its form and however it is typed, a secret learnt from the overrides is replaced in every
    serialisation (Hydra's escapes, YAML folding, JSON escapes, shell quoting, repr); scrubbing is idempotent and
    YAML and JSON stay readable. An override Hydra cannot parse is refused by an error line without the secret."""
    from hydra.errors import HydraException

    from trainer.compose.compose import describe_error

    key, value, canary = FORMS[form]
    override = SYNTAXES[syntax](key, value)
    redactor = Redactor().learn_overrides([override]).freeze()
    try:
        parsed, texts = serialisations(override)
    except HydraException as err:  # e.g. a plain value holding a quote: the error line names no secret
        line = redact_error(describe_error(err), [override])
        assert canary not in line and canary not in redact_argv([override])[0], line
        return
    if isinstance(value, str) and syntax != "list element":
        assert parsed == value, (override, parsed)  # the syntax carries the value Hydra reads
    for name, text in texts.items():
        clean = redactor.scrub(text)
        assert canary not in clean, (name, text, clean)
        assert redactor.scrub(clean) == clean, (name, clean)
        if name.startswith("json") or name == "argv.json":
            json.loads(clean)
        if name in ("config.yaml", "yaml block", "hydra yaml list"):
            yaml.safe_load(clean)
    assert canary not in " ".join(redact_argv([override]))


@pytest.mark.parametrize(
    "env,canary",
    [
        ({"CUSTOM_HEADERS": json.dumps({"Authorization": "Bearer cnrCustom19", "Accept": "x"})}, "cnrCustom19"),
        ({"SSHPASS": "cnrSshpass20"}, "cnrSshpass20"),
        ({"PIP_INDEX_URL": "https://u:pa'cnrPip21@pypi.example/simple"}, "cnrPip21"),
        ({"sshpass": "cnrSshpass22"}, "cnrSshpass22"),
    ],
)
def test_an_inherited_secret_leaves_no_trace(env, canary):
    """Promise: secrets of the caller's environment (a JSON of headers, SSHPASS, a URL password with a quote) are
    learnt and replaced in every serialisation of that environment (job.json, logs)."""
    from trainer.redact import redact_env

    redactor = Redactor().learn_env(env).freeze()
    texts = [
        json.dumps(env),
        json.dumps({"env": env}, indent=2),
        yaml.safe_dump(env),
        repr(env),
        json.dumps(json.dumps(env)),
        " ".join(f"export {k}={shlex.quote(v)}" for k, v in env.items()),
    ]
    for text in texts:
        assert canary not in redactor.scrub(text), text
    assert canary not in json.dumps(redact_env(env))  # job.json's env, even without the run's redactor
    assert canary not in Redactor().freeze().scrub(json.dumps(redact_env(env)))


@pytest.mark.parametrize(
    "name,secret",
    [
        ("hf_token", True),
        ("HfToken", True),
        ("--hf-token", True),
        ("--redis-password", True),
        ("Api-Key", True),
        ("X-Api-Key", True),
        ("Authorization", True),
        ("access_token", True),
        ("SSHPASS", True),
        ("api_key", True),
        ("input_key", False),
        ("metadata_key", False),
        ("moe_token_dispatcher_type", False),
        ("active_per_token", True),
        ("supervised_token_ratio", False),
        ("sign-key", False),
        ("key", False),
        ("row_tokens", False),
    ],
)
def test_names_are_matched_case_insensitively_by_rule(name, secret):
    """Promise: names are secret by one rule in any case (a config key, flag or header by its last word); the
    config's own keys that merely hold a word like token or key stay readable."""
    assert is_secret_name(name) is secret


def test_no_over_redaction_of_ordinary_text():
    """Tamper check of the rule: ordinary config, plan numbers and prose keep their values (redaction must not
    break config.yaml, plan.json or command.sh), while the same lines with a secret name lose theirs."""
    r = Redactor().freeze()
    ordinary = [
        "  input_key: messages\n",
        '    "active_per_token": 37000000000,\n',
        "--input-key messages\n",
        'export hf_token="${hf_token:?hf_token is a secret: set it in the environment}"\n',
        "error (key: optim.lr)\n",
        "moe_token_dispatcher_type: alltoall\n",
        "lr=1e-5 grad_norm=0.5\n",
    ]
    for text in ordinary:
        assert r.scrub(text) == text, text
    hostile = [
        "  api_key: cnrq\n",
        '    "HF_TOKEN": "cnrq",\n',
        "--hf-token cnrq\n",
        "hf_token=cnrq\n",
        "X-Api-Key: cnrq\n",
        "https://u:cnrq@h/\n",
        "https\\://u\\:cnrq@h/\n",
        "x#access_token=cnrq\n",
    ]
    for text in hostile:
        assert "cnrq" not in r.scrub(text) and REDACTED in r.scrub(text), text


def test_a_folded_yaml_value_found_by_its_name_is_redacted_whole():
    """Promise: a value found by its secret name alone (not learnt) is replaced with its folded continuation lines;
    the next key stays."""
    text = yaml.safe_dump({"api_key": "alpha " * 20 + "cnrFold", "other": "kept"}, width=40)
    assert "\n  " in text  # folded
    clean = Redactor().freeze().scrub(text)
    assert (
        "cnrFold" not in clean
        and "alpha" not in clean
        and yaml.safe_load(clean) == {"api_key": REDACTED, "other": "kept"}
    )


def test_error_lines_and_checks_show_no_secret_value():
    """Promise: an error line is built from redacted values: Hydra's repeats of a value (however short) and our own
    checks name the field and say what was expected, with the value redacted."""
    assert (
        redact_error("Cannot convert 'list' to string: '['ab', 'c']'", ["+env.API_KEY=[ab,c]"])
        == "Cannot convert 'list' to string: '['<redacted>', '<redacted>']'"
    )
    assert redact_error("The value of 'env.HF_TOKEN' is 'x' and not 'wr'", ["~env.HF_TOKEN=wr"]).endswith(
        "not '<redacted>'"
    )
    assert redact_field("env.HF_TOKEN", "$anything") == REDACTED
    assert redact_field("launcher.time_limit", "https://u:zq@h") == "https://<redacted>@h"
    assert redact_field("launcher.time_limit", "04:00") == "04:00"  # a value without a secret is shown as it is


def test_an_unset_variable_is_named_without_its_value(tmp_path):
    """Promise: "refers to a variable that is not set" names the variable; a secret one's value is not shown, another
    one's loses its URL password."""
    from trainer.errors import UserError
    from trainer.launch.host.processes import worker_env

    for env, hidden in (
        ({"HF_TOKEN": "cnrUnset26$NOPE_X"}, "cnrUnset26"),
        ({"MIRROR": "https://u:zq@h/$NOPE_X"}, "zq"),
    ):
        with pytest.raises(UserError) as err:
            worker_env(env, {}, tmp_path)
        assert "refers to a variable that is not set" in str(err.value) and hidden not in str(err.value), err.value
        assert f"env.{next(iter(env))}" in str(err.value)


def test_stdout_and_stderr_pass_through_the_redactor(capsys):
    """Promise: Hydra's "Error executing job with overrides" header (hydra.core.utils.JobReturn) and its multirun
    "#0 : overrides" log lines reach stderr/stdout redacted, also when written in pieces."""
    import logging

    from hydra.core.utils import JobReturn, JobStatus

    redactor = Redactor().learn_overrides(["+env.HF_TOKEN=cnrStream23", "paths.ref_load=https://u:zq@h"]).freeze()
    with redacted_streams(redactor):
        job = JobReturn(
            overrides=["+env.HF_TOKEN=cnrStream23", "paths.ref_load=https\\://u\\:zq@h"],
            status=JobStatus.FAILED,
            _return_value=RuntimeError("boom"),
        )
        with pytest.raises(RuntimeError):
            _ = job.return_value  # the property raises the job's error
        handler = logging.StreamHandler(sys.stdout)
        log = logging.getLogger("test_hostile_secrets")
        log.addHandler(handler)
        log.warning("\t#0 : +env.HF_TOKEN=cnrStream23 paths.ref_load=https\\://u\\:zq@h")
        log.removeHandler(handler)
        sys.stdout.write("partial cnrStr")
        sys.stdout.write("eam23 line\n")
    out = capsys.readouterr()
    assert "Error executing job with overrides" in out.err and "#0 :" in out.out
    assert "cnrStream23" not in out.out + out.err and "zq" not in out.out + out.err, out
    assert not isinstance(sys.stdout, RedactingStream) and not isinstance(sys.stderr, RedactingStream)  # restored


# ------------------------------------------------------------------------------------------ the sweep


def test_the_sweep_covers_nul_bytes_and_files_over_256_mib(tmp_path):
    """Promise: the after-run sweep redacts files holding a NUL byte and files larger than 256 MiB (read in
    chunks; a secret across a chunk's end included), leaves other bytes as they were, and keeps the file's mode."""
    redactor = Redactor().learn_overrides(["+env.HF_TOKEN=cnrSweep24xy"]).freeze()
    small = tmp_path / "probe.bin"
    small.write_bytes(b"\x00\x01\xff HF_TOKEN=cnrSweep24xy \x00\napi_key: otherval\n\xfe")
    big = tmp_path / "big.log"
    line = b"0123456789" * 10 + b"\n"
    with big.open("wb") as out:
        out.write(line * ((257 << 20) // len(line) + 1))
        out.seek(CHUNK_BYTES - 5)  # across the end of the first chunk
        out.write(b"cnrSweep24xy\x00")
        out.seek(200 << 20)
        out.write(b"\nHF_TOKEN=cnrLate25\n")
    size = big.stat().st_size
    assert size > 256 << 20
    big.chmod(0o640)
    changed = sweep(tmp_path, redactor)
    small_inode = small.stat().st_ino
    assert changed == ["big.log", "probe.bin"]
    assert small.read_bytes() == b"\x00\x01\xff HF_TOKEN=<redacted> \x00\napi_key: <redacted>\n\xfe"
    data = big.read_bytes()
    assert b"cnrSweep24xy" not in data and b"cnrLate25" not in data and data.count(REDACTED.encode()) == 2
    assert len(data) == size - len("cnrSweep24xy") - len("cnrLate25") + 2 * len(REDACTED)
    assert big.stat().st_mode & 0o777 == 0o640
    assert not scrub_file(small, redactor) and small.stat().st_ino == small_inode  # redacted once: not rewritten
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary copy left


# ------------------------------------------------------------------------------------------ end to end

KEY_VALUE = {  # one override per key: the forms that fit the schema, in several syntaxes
    "paths.ref_load='https://u:p(cnrE2e1)w:x@host/x'": "cnrE2e1",
    "paths.hf_checkpoint=https://u:s7Cpw@host/x": "s7Cpw",
    "paths.prompt_data='https://host/x#access_token=cnrE2e3'": "cnrE2e3",
    "+env.hf_token=lc7abcd": "lc7abcd",
    "++env.HfToken=cnrE2e5": "cnrE2e5",
    (
        "launcher.job=[x,HF_TOKEN\\=cnrE2e6,'--hf-token=cnrE2e7',--api-key,cnrE2e8,'Authorization: Bearer cnrE2e9']"
    ): "cnrE2e6 cnrE2e7 cnrE2e8 cnrE2e9",
    "launcher.ray_start_args=['--redis-password=cnrE2e10','--password=cnrE2e11']": "cnrE2e10 cnrE2e11",
    "+env.X_KEY=$cnrE2e12": "cnrE2e12",
    "+env.LONG_SECRET='" + " ".join(["word"] * 20 + ["cnrE2e13"] + ["tail"] * 10) + "'": "cnrE2e13",
    "+env.QUOTE_PASSWORD='it\\'s cnrE2e14'": "cnrE2e14",
    "+env.NL_SECRET='first line\ncnrE2e19 second'": "cnrE2e19",
}
INHERITED = {
    "CUSTOM_HEADERS": json.dumps({"Authorization": "Bearer cnrE2e15", "X-Api-Key": "cnrE2e16"}),
    "SSHPASS": "cnrE2e17",
    "PIP_INDEX_URL": "https://u:pa'cnrE2e18@pypi.example/simple",
}
CANARIES = [c for v in KEY_VALUE.values() for c in v.split()] + [
    "cnrE2e15",
    "cnrE2e16",
    "cnrE2e17",
    "cnrE2e18",
    "second",
]  # the second line of a value too


def leaks(directory: Path, canaries, *texts):
    """(where, canary) for every canary in a file's raw bytes, in a DSSE payload (base64) or in ``texts``."""
    found = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and not p.is_symlink()):
        data = path.read_bytes()
        blobs = [data]
        if path.name == "attestation.json":
            envelope = json.loads(data)
            if "payload" in envelope:
                blobs.append(base64.b64decode(envelope["payload"]))
        found += [(str(path.relative_to(directory)), c) for c in canaries for b in blobs if c.encode() in b]
    found += [("output", c) for c in canaries for t in texts if c in t]
    return found


def assert_readable(run_dir: Path):
    for path in run_dir.rglob("*.json"):
        json.loads(path.read_text())
    for path in list(run_dir.rglob("*.yaml")):
        yaml.safe_load(path.read_text())
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["data"]  # the composition is still there


def test_no_secret_form_reaches_a_run_directory_or_the_output(tmp_path):
    """Promise (end to end, launcher=plan): every secret form, typed in several syntaxes, and the caller's inherited
    secrets appear in no file of the run directory (.hydra/ included) nor on stdout/stderr; exit 0, files readable."""
    run_dir = tmp_path / "run"
    result = run_train([f"hydra.run.dir={run_dir}", *KEY_VALUE], cwd=tmp_path, env=INHERITED)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (run_dir / ".hydra" / "overrides.yaml").is_file() and (run_dir / "record.json").is_file()
    assert leaks(run_dir, CANARIES, result.stdout, result.stderr) == []
    assert_readable(run_dir)
    assert os.system(f"bash -n {run_dir / 'command.sh'}") == 0


def test_a_rendered_sbatch_script_keeps_no_secret_and_stays_valid(tmp_path):
    """Promise: sbatch.sh (launcher=slurm, rendered, not submitted) holds no secret of a lower-case env name, of
    ray_start_args flags or of a header in the job, and stays valid bash where a value was redacted."""
    import subprocess

    run_dir = tmp_path / "run"
    result = run_train(
        [
            f"hydra.run.dir={run_dir}",
            "launcher=slurm",
            "launcher.container=none",
            "+env.hf_token=lc7abcd",
            "launcher.ray_start_args=['--redis-password=cnrSb1xx',--password,cnrSb2xx]",
            "launcher.job=[x,'Api-Key: cnrSb3xx']",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert leaks(run_dir, ["lc7abcd", "cnrSb1xx", "cnrSb2xx", "cnrSb3xx"], result.stdout, result.stderr) == []
    script = (run_dir / "sbatch.sh").read_text()
    assert "--redis-password='<redacted>'" in script
    assert subprocess.run(["bash", "-n", str(run_dir / "sbatch.sh")]).returncode == 0


def test_a_multirun_prints_and_keeps_no_secret(tmp_path):
    """Promise: a multirun's "#0 : overrides" lines, multirun.yaml and every job's files keep no secret, also the
    values a sweep is over."""
    sweep_dir = tmp_path / "sweep"
    result = run_train(
        [
            "-m",
            f"hydra.sweep.dir={sweep_dir}",
            "+env.hf_token=cnrMr1a,cnrMr2b",
            "paths.ref_load=https://u:s7Cpw@host/x",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "#0 :" in result.stdout + result.stderr and len(list(sweep_dir.glob("*/plan.json"))) == 2
    assert leaks(sweep_dir, ["cnrMr1a", "cnrMr2b", "s7Cpw"], result.stdout, result.stderr) == []


def test_a_signed_failing_run_signs_no_secret(tmp_path):
    """Promise: a failing run's reason (launcher.address with a URL password) reaches neither record.json nor the
    signed predicate (the DSSE payload, base64) nor stdout; the reason says <redacted> where the password was."""
    assert helpers.run_trainer("keygen", "--out", tmp_path / "key").returncode == 0
    run_dir = tmp_path / "run"
    result = run_train(
        [
            f"hydra.run.dir={run_dir}",
            "launcher=ray",
            "launcher.address=http://u:zq9@127.0.0.1:9",
            "--sign-key",
            str(tmp_path / "key"),
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "zq9" not in result.stdout + result.stderr and "http://<redacted>@127.0.0.1:9" in result.stdout
    envelope = json.loads((run_dir / "attestation.json").read_text())
    predicate = json.loads(base64.b64decode(envelope["payload"]))["predicate"]
    assert predicate["run"]["status"] == "failed" and "http://<redacted>@127.0.0.1:9" in predicate["run"]["reason"]
    assert leaks(run_dir, ["zq9"]) == []


@pytest.fixture
def train_here(refused_train):
    return refused_train


REFUSED = {
    "a list for a secret string": (["+env.API_KEY=[listCnrR1,b]"], "listCnrR1", "env.API_KEY"),
    "an unterminated quote": (["+env.HF_TOKEN='cnrR2abc"], "cnrR2abc", "+env.HF_TOKEN"),
    "a delete of another value": (["+env.HF_TOKEN=cnrR3real", "~env.HF_TOKEN=cnrR3wrong"], "cnrR3", "env.HF_TOKEN"),
    "a secret where a number is expected": (["+env.HF_TOKEN=cnrR4", "optim.lr=${env.HF_TOKEN}"], "cnrR4", "optim.lr"),
    "a short secret where a number is expected": (["+env.HF_TOKEN=zq", "optim.lr=${env.HF_TOKEN}"], "'zq'", "optim.lr"),
    "a sweep without -m": (["+env.HF_TOKEN=cnrR5a,cnrR5b"], "cnrR5", "multirun"),
    "a URL password in container_mounts": (
        ["launcher=slurm", "launcher.container=none", "launcher.container_mounts=[/a:/b:https://u:zq@h/x:/y]"],
        ":zq@",
        "launcher.container_mounts",
    ),
    "a URL password in time_limit": (
        ["launcher=slurm", "launcher.container=none", "launcher.time_limit=https://u:zq@h"],
        ":zq@",
        "launcher.time_limit",
    ),
    "a URL password in sbatch_args": (
        ["launcher=slurm", "launcher.container=none", "launcher.sbatch_args=['--x=https://u:zq@h/ s']"],
        ":zq@",
        "launcher.sbatch_args[0]",
    ),
    "a URL password in launcher.address": (
        ["launcher=ray", "launcher.address=ftp://u:zq@h"],
        ":zq@",
        "launcher.address",
    ),
    "a URL password in a checked string": (["optim.lr_decay_style=https://u:zq@h"], ":zq@", "optim.lr_decay_style"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_refusal_is_one_line_without_the_secret(tmp_path, train_here, case):
    """Promise: Hydra's lexer and conversion errors and our own checks are refused in one line (exit 2, no
    traceback) naming the field, without the secret value."""
    args, canary, named = REFUSED[case]
    result = train_here([f"hydra.run.dir={tmp_path / 'run'}", *args], cwd=tmp_path)
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert named in result.stderr and canary not in result.stdout + result.stderr, result.stderr
    assert not (tmp_path / "run").exists()


def test_resume_refuses_a_symlinked_hydra_folder(tmp_path, train_here):
    """Promise: under --resume a run directory holding a symbolic link (.hydra -> elsewhere) is refused before Hydra
    writes the overrides through it; the link's target is left as it was."""
    run_dir = helpers.planned_run(tmp_path)
    outside = tmp_path / "outside"
    (run_dir / ".hydra").rename(outside)
    (run_dir / ".hydra").symlink_to(outside)
    before = helpers.tree_hash(outside)
    result = train_here([f"hydra.run.dir={run_dir}", "--resume"], cwd=tmp_path)  # the same composition
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert ".hydra: a symbolic link" in result.stderr and "Traceback" not in result.stderr
    assert helpers.tree_hash(outside) == before


# ------------------------------------------------------------------------------- links, full disks, a full stdout

CANARY = "SuperSecretValue42"


@pytest.mark.parametrize("link", [".hydra/hydra.yaml", ".hydra", "train.log"])
def test_a_link_in_a_new_run_directory_is_refused_and_nothing_is_written_through_it(tmp_path, link):
    """Promise: in every mode (not only --resume) a run directory holding a symbolic link is refused before Hydra
    writes: Hydra would otherwise overwrite what it points to with the overrides, secret included."""
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "hydra.yaml").write_text("precious: yes\n")
    target = precious if link == ".hydra" else precious / "hydra.yaml"
    run = tmp_path / "run"
    (run / link).parent.mkdir(parents=True, exist_ok=True)
    (run / link).symlink_to(target)
    before = helpers.tree_hash(precious)
    r = run_train([f"hydra.run.dir={run}", f"+env.HF_TOKEN={CANARY}"], cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"train: error: {run / link}: a symbolic link in the run directory; train writes Hydra's files (.hydra/, "
        "train.log) only into a directory without links: remove it"
    ]
    assert helpers.tree_hash(precious) == before


@pytest.mark.parametrize(
    "args", [["layout=tp2pp4ep8"], ["--help"], ["--cfg", "job"], ["-m", "layout=tp2pp4ep8,tp8pp8ep8"]]
)
def test_a_full_standard_output_is_one_line_on_stderr(tmp_path, args):
    """Promise: standard output on a full disk (here /dev/full) is one line naming it, exit 2, no traceback; the
    run's own files are complete (the record of a plan says planned)."""
    run = tmp_path / "run"
    where = [f"hydra.sweep.dir={run}"] if "-m" in args else [f"hydra.run.dir={run}"]
    with open("/dev/full", "w") as full:
        env = {**os.environ, "PYTHONPATH": str(helpers.REPO_ROOT), "COLUMNS": "160"}
        r = subprocess.run(
            [sys.executable, "-m", "trainer.train", *args, *where],
            cwd=tmp_path,
            env=env,
            stdout=full,
            stderr=-1,
            text=True,
            timeout=120,
        )
    assert r.returncode == 2 and r.stderr.splitlines() == ["train: error: standard output: no space left on device"]
    if args == ["layout=tp2pp4ep8"]:
        assert json.loads((run / "record.json").read_text())["status"] == "planned"


NAMESPACE_DRIVER = r"""
import json, os, subprocess, sys
base, repo, canary = sys.argv[1], sys.argv[2], sys.argv[3]
env = {**os.environ, "PYTHONPATH": repo, "COLUMNS": "160"}
out = {}
for kb in (8, 12, 16, 20, 24, 36):
    fs = f"{base}/fs{kb}"
    os.makedirs(fs)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kb}k", "tmpfs", fs], check=True)
    p = subprocess.run([sys.executable, "-m", "trainer.train", f"hydra.run.dir={fs}/run", f"+env.HF_TOKEN={canary}"],
                       cwd=base, env=env, capture_output=True, text=True, timeout=120)
    leaks = [os.path.join(d, n) for d, _, names in os.walk(fs) for n in names
             if canary.encode() in open(os.path.join(d, n), "rb").read()]
    out[kb] = {"rc": p.returncode, "stderr": p.stderr, "leaks": leaks}
    subprocess.run(["umount", fs], check=True)
print(json.dumps(out))
"""


@pytest.mark.skipif(not helpers.tmpfs_namespace(), reason="no mount namespace can be made here: no tmpfs to fill")
def test_a_full_disk_leaves_no_secret_in_what_hydra_wrote(tmp_path):
    """Promise: however early a full disk stops a run (while Hydra writes .hydra/, or at the run's files), what
    was written is redacted (rewritten in place, or emptied where even that has no room), and the error line names
    the file that failed."""
    r = subprocess.run(
        [
            *helpers.tmpfs_namespace(),
            sys.executable,
            "-c",
            NAMESPACE_DRIVER,
            str(tmp_path),
            str(helpers.REPO_ROOT),
            CANARY,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    cases = json.loads(r.stdout)
    for kb, case in cases.items():
        assert case["leaks"] == [], (kb, case)
        assert case["rc"] == 2 and "Traceback" not in case["stderr"], (kb, case)
        errors = [line for line in case["stderr"].splitlines() if line.startswith("train: error: ")]
        assert len(errors) == 1 and errors[0].endswith(": no space left on device"), (kb, case)
    assert any(".hydra" in case["stderr"] for case in cases.values())  # some sizes fill it while Hydra writes


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
