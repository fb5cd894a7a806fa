"""Hostile input to `train` and its run directory: no secret in any file, no run overwritten, bad values refused.

Every refusal is checked the same way (:func:`assert_refused`): exit code 2, one line on stderr naming the field,
no traceback, and the directory byte for byte as before (nothing written, nothing removed).
"""

import hashlib
from pathlib import Path

import pytest

import helpers
from helpers import planned_run, run_train, tree_hash
from trainer.redact import Redactor, is_secret_name, redact_value

# ------------------------------------------------------------------------------------------ the rule


@pytest.mark.parametrize(
    "name,secret",
    [
        ("HF_TOKEN", True),
        ("GITHUB_PAT", True),
        ("GH_PAT", True),
        ("aws_secret_access_key", True),
        ("DB_PASSWORD", True),
        ("PGPASSWORD", True),
        ("GCP_CREDENTIALS", True),
        ("hfToken", True),
        ("X-Amz-Signature", True),
        ("sig", True),
        ("WANDB_API_KEY", True),
        ("OPENAI_APIKEY", True),
        ("NPM_AUTH", True),
        ("SSH_PRIVATE", True),
        ("SESSION_COOKIE", True),
        ("PATH", False),
        ("KEYBOARD", False),
        ("TOKENIZER", False),
        ("row_tokens", False),
        ("PATTERN", False),
        ("CUDA_DEVICE_MAX_CONNECTIONS", False),
        ("TRITON_CACHE_DIR", False),
        ("PYTORCH_CUDA_ALLOC_CONF", False),
    ],
)
def test_secret_names_follow_one_rule(name, secret):
    """Promise: a name is secret when one of its words is a secret word (TOKEN, PAT, KEY, PASSWORD, ...)."""
    assert is_secret_name(name) is secret


@pytest.mark.parametrize(
    "value,secret,kept",
    [
        ("https://user:pa/ss@host/x", "pa/ss", "host/x"),
        ("https://user:p@ss@host/x", "p@ss", "host/x"),
        ("https://ghp_abcdef123@github.com/o/r.git", "ghp_abcdef123", "github.com/o/r.git"),
        ("s3://u:pw@bucket/rows", "pw", "bucket/rows"),
        ("https://host/file?token=abc123&x=1", "abc123", "x=1"),
        ("https://host/file?X-Amz-Signature=deadbeef#frag", "deadbeef", "#frag"),
        ("export HF_TOKEN=hf_abc; echo", "hf_abc", "echo"),
    ],
)
def test_secret_values_are_redacted(value, secret, kept):
    """Promise: credentials in URLs (passwords holding / or @ included), secret query values and NAME=VALUE secrets
    never survive redaction; the rest of the text does."""
    out = redact_value(value)
    assert secret not in out and "<redacted>" in out and kept in out, out


def test_a_learnt_secret_is_redacted_everywhere():
    """Promise: a value learnt from the overrides is replaced in any later text, whatever surrounds it."""
    redactor = Redactor().learn_overrides(["+env.HF_TOKEN=hf_secret_value_1"])
    assert redactor.scrub('{"x": "prefix hf_secret_value_1 suffix"}') == '{"x": "prefix <redacted> suffix"}'


# ------------------------------------------------------------------------------------------ helpers


def assert_refused(result, expected: str, watched: Path, before: str):
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train: error: "), result.stderr
    assert expected in lines[0], lines[0]
    assert tree_hash(watched) == before


# ------------------------------------------------------------------------------------------ secrets

SECRETS = {
    "env token": ("+env.HF_TOKEN=hf_live_0123456789", "hf_live_0123456789"),
    "personal access token": ("+env.GITHUB_PAT=ghp_abcdefghijklmnop", "ghp_abcdefghijklmnop"),
    "url password with / and @": ("+env.MIRROR_URL='https://me:pa/ss@w0rd@mirror.example/simple'", "pa/ss@w0rd"),
    "query token": ("+env.DATA_URL='https://data.example/rows.parquet?token=qtok_987654321'", "qtok_987654321"),
    "url password in a path field": ("paths.prompt_data='s3://reader:s3cr3t_pw_42@bucket/rows'", "s3cr3t_pw_42"),
}


@pytest.fixture(scope="module")
def secret_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("secrets")
    run_dir = tmp / "run"
    result = run_train([f"hydra.run.dir={run_dir}", *(o for o, _ in SECRETS.values())], cwd=tmp)
    assert result.returncode == 0, result.stderr
    return run_dir, result


@pytest.mark.parametrize("case", sorted(SECRETS))
def test_no_secret_reaches_any_file_of_a_run_directory(secret_run, case):
    """Promise: a secret given on the command line appears in no file of the run directory (env.json, config.yaml,
    command.sh, .hydra/*, record.json, ...), nor in what train prints."""
    run_dir, result = secret_run
    secret = SECRETS[case][1]
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert {"env.json", "config.yaml", "command.sh", "record.json", "plan.json", "argv.json"} <= {p.name for p in files}
    assert {".hydra/config.yaml", ".hydra/overrides.yaml", ".hydra/hydra.yaml"} <= {
        str(p.relative_to(run_dir)) for p in files
    }
    leaks = [str(p.relative_to(run_dir)) for p in files if secret.encode() in p.read_bytes()]
    assert leaks == [], f"{secret} in {leaks}"
    assert secret not in result.stdout + result.stderr


def test_no_secret_reaches_any_file_of_a_multirun(tmp_path):
    """Promise: in a multirun, neither the jobs' directories nor Hydra's record of the sweep (multirun.yaml) keep a
    secret given on the command line, also one the sweep is over."""
    sweep_dir = tmp_path / "sweep"
    overrides = [o for o, _ in SECRETS.values()]
    swept = ("k1x2y3", "k4z5w6")  # too short for the redactor to learn one by one: the sweep as typed is learned
    result = run_train(
        [
            "-m",
            f"hydra.sweep.dir={sweep_dir}",
            "layout=tp2pp4ep8,tp8pp8ep8",
            *overrides,
            f"+env.WANDB_API_KEY={','.join(swept)}",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    files = [p for p in sweep_dir.rglob("*") if p.is_file()]
    assert "multirun.yaml" in {p.name for p in files} and len(list(sweep_dir.glob("*/plan.json"))) == 4
    secrets = [s for _, s in SECRETS.values()] + list(swept)
    leaks = [(str(p.relative_to(sweep_dir)), s) for p in files for s in secrets if s.encode() in p.read_bytes()]
    assert leaks == []


def test_the_redacted_run_stays_consistent(secret_run):
    """Promise: redaction keeps the run usable: command.sh takes secrets from the caller's environment and
    record.json's hashes are those of the files as written."""
    import json
    import subprocess

    run_dir, _ = secret_run
    script = (run_dir / "command.sh").read_text()
    assert 'export HF_TOKEN="${HF_TOKEN:?HF_TOKEN is a secret: set it in the environment}"' in script
    assert subprocess.run(["bash", "-n", str(run_dir / "command.sh")]).returncode == 0
    record = json.loads((run_dir / "record.json").read_text())
    for name, digest in record["files_sha256"].items():
        assert hashlib.sha256((run_dir / name).read_bytes()).hexdigest() == digest, name
    assert json.loads((run_dir / "env.json").read_text())["HF_TOKEN"] == "<redacted>"


def test_a_parse_error_names_the_override_without_its_secret(tmp_path, refused_train):
    """Promise: an override Hydra cannot parse is named in the one-line error, with its secret redacted."""
    result = refused_train(["optim.lr=1e-5", "data.path=https://u:hunter2pw@h/x?token=zzz=1"], cwd=tmp_path)
    assert_refused(
        result, "override 'data.path=https://<redacted>@h/x?token=<redacted>", tmp_path / "outputs", "absent"
    )
    assert "hunter2pw" not in result.stderr


# ------------------------------------------------------------------------------------------ the run directory's owner


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    return planned_run(tmp_path_factory.mktemp("owner"))


def _user_dir(tmp: Path) -> Path:
    (tmp / "mine").mkdir()
    (tmp / "mine" / "notes.txt").write_text("my own file\n")
    return tmp / "mine"


def _a_file(tmp: Path) -> Path:
    (tmp / "file").write_text("x")
    return tmp / "file"


OWNER_CASES = {
    # name: (value builder (tmp, planned) -> (hydra.run.dir value, watched path), expected message)
    "another run": (lambda tmp, run: (str(run), run), "holds another run (status planned); pass --resume"),
    "user files": (lambda tmp, run: (str(_user_dir(tmp)), tmp / "mine"), "holds files that no run wrote (notes.txt)"),
    "empty value": (lambda tmp, run: ("", tmp), "hydra.run.dir: empty"),
    "filesystem root": (lambda tmp, run: ("/", tmp), "the filesystem root cannot be a run directory"),
    "current directory": (lambda tmp, run: (".", tmp), "the current directory"),
    "a file": (lambda tmp, run: (str(_a_file(tmp)), tmp / "file"), "exists and is not a directory"),
    "read-only place": (lambda tmp, run: ("/proc/self/run", tmp), "cannot write in /proc"),
    "under a file": (lambda tmp, run: (str(_a_file(tmp) / "run"), tmp / "file"), "is not a directory"),
}


@pytest.mark.parametrize("case", sorted(OWNER_CASES))
def test_a_run_directory_is_refused_unless_it_is_free(planned, tmp_path, case, refused_train):
    """Promise: train writes only into a new or empty directory it may write; anything else is one line, exit 2,
    and the place is left exactly as it was (a finished run keeps its record and metrics)."""
    build, expected = OWNER_CASES[case]
    value, watched = build(tmp_path, planned)
    before = tree_hash(watched)
    result = refused_train([f"hydra.run.dir={value}"], cwd=tmp_path)
    assert_refused(result, expected, watched, before)


def test_resume_and_overwrite_are_asked_for(planned, tmp_path, refused_train):
    """Promise: --resume writes into an existing run (its other files stay); --overwrite replaces the run."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(planned, run_dir)
    assert run_train([f"hydra.run.dir={run_dir}", "--resume"], cwd=tmp_path).returncode == 0
    assert (run_dir / "metrics.jsonl").is_file()
    assert run_train([f"hydra.run.dir={run_dir}", "--overwrite"], cwd=tmp_path).returncode == 0
    assert not (run_dir / "metrics.jsonl").exists() and (run_dir / "record.json").is_file()
    both = refused_train([f"hydra.run.dir={run_dir}", "--overwrite", "--resume"], cwd=tmp_path)
    assert both.returncode == 2 and both.stderr == "train: error: --resume and --overwrite exclude each other\n"


# ---------------------------------------------------------------------------------------- an interpolated run directory


def _home(tmp: Path) -> Path:
    (tmp / "home").mkdir()
    (tmp / "home" / ".bashrc").write_text("# mine\n")
    return tmp / "home"


INTERPOLATED = {
    # name: (arguments, environment builder (tmp) -> {NAME: value}, watched (tmp) -> path, expected message)
    "current directory, --resume": (
        ["hydra.run.dir=${oc.env:PWD}", "--resume"],
        lambda tmp: {"PWD": str(tmp)},
        lambda tmp: tmp,
        "hydra.run.dir=TMP: the current directory",
    ),
    "one above, --overwrite": (
        ["hydra.run.dir=${oc.env:PWD}/..", "--overwrite"],
        lambda tmp: {"PWD": str(tmp)},
        lambda tmp: tmp,
        "one above it",
    ),
    "home, --overwrite": (
        ["hydra.run.dir=${oc.env:HOME}", "--overwrite"],
        lambda tmp: {"HOME": str(_home(tmp))},
        lambda tmp: tmp / "home",
        "the home directory cannot be a run directory",
    ),
    "user files, --overwrite": (
        ["hydra.run.dir=${oc.env:MINE}", "--overwrite"],
        lambda tmp: {"MINE": str(_user_dir(tmp))},
        lambda tmp: tmp / "mine",
        "holds files that no run wrote (notes.txt)",
    ),
    "root": (
        ["hydra.run.dir=${oc.env:ROOT_DIR}"],
        lambda tmp: {"ROOT_DIR": "/"},
        lambda tmp: tmp,
        "the filesystem root cannot be a run directory",
    ),
    "unresolvable": (
        ["hydra.run.dir=${oc.env:TRAIN_TEST_NOT_SET}/run", "--resume"],
        lambda tmp: {},
        lambda tmp: tmp,
        "hydra.run.dir cannot be resolved",
    ),
    "resolves to null": (
        ["hydra.run.dir=${oc.env:TRAIN_TEST_NOT_SET,null}"],
        lambda tmp: {},
        lambda tmp: tmp,
        "hydra.run.dir cannot be resolved",
    ),
    "sweep dir, --overwrite": (
        ["-m", "hydra.sweep.dir=${oc.env:PWD}", "layout=tp2pp4ep8,tp8pp8ep8", "--overwrite"],
        lambda tmp: {"PWD": str(tmp)},
        lambda tmp: tmp,
        "hydra.sweep.dir=TMP: the current directory",
    ),
}


@pytest.mark.parametrize("case", sorted(INTERPOLATED))
def test_an_interpolated_run_directory_is_resolved_then_claimed(tmp_path, case, refused_train, monkeypatch):
    """Promise (bug: ``${...}`` skipped every check): a run directory named with an interpolation is resolved
    before it is claimed and the resolved path meets the same rules: the current directory, one above it, the
    home directory, the root and a directory of the user's files stay refused with --resume and --overwrite too;
    a value that cannot be resolved is one line naming the field. Nothing is written or removed."""
    args, environment, watch, expected = INTERPOLATED[case]
    (tmp_path / "config.yaml").write_text("my own config\n")  # what `${oc.env:PWD} --resume` replaced
    for name, value in environment(tmp_path).items():
        monkeypatch.setenv(name, value)
    watched = watch(tmp_path)
    before = tree_hash(watched)
    result = refused_train(args, cwd=tmp_path)
    assert_refused(result, expected.replace("TMP", str(tmp_path)), watched, before)


def test_an_interpolated_run_directory_is_resolved_once(tmp_path):
    """Promise: Hydra writes the run into the directory that was claimed: an interpolation (``now`` to the
    microsecond, ``hydra:``, ``oc.env``) is resolved once and the literal replaces it, in what Hydra records
    (``.hydra/hydra.yaml``) and in the record's command; --resume of the same literal directory then works."""
    import json

    import yaml

    runs = tmp_path / "runs"
    value = "${oc.env:RUNS}/${now:%H-%M-%S.%f}-${hydra:job.name}-${layout.name}"
    result = run_train([f"hydra.run.dir={value}"], cwd=tmp_path, env={"RUNS": str(runs)})
    assert result.returncode == 0, result.stderr
    made = list(runs.iterdir())
    assert len(made) == 1 and made[0].name.endswith("-train-tp2pp4ep8"), made
    run_dir = made[0]
    hydra_yaml = yaml.safe_load((run_dir / ".hydra" / "hydra.yaml").read_text())["hydra"]
    assert hydra_yaml["run"]["dir"] == str(run_dir)
    assert hydra_yaml["overrides"]["hydra"][0] == f"hydra.run.dir='{run_dir}'"
    record = json.loads((run_dir / "record.json").read_text())
    assert f"hydra.run.dir='{run_dir}'" in record["command"] and not any("{" in w for w in record["command"])
    again = run_train(["hydra.run.dir=${oc.env:RUN}", "--resume"], cwd=tmp_path, env={"RUN": str(run_dir)})
    assert again.returncode == 0, again.stderr
    assert list(runs.iterdir()) == [run_dir]


# --------------------------------------------------------------------------------------- --overwrite removes only a run


NOT_A_RUNS_RECORD = {
    "an index of mine": '{"shards": 2}\n',
    "unknown status": '{"status": "done", "files_sha256": {}}\n',
    "no files_sha256": '{"status": "planned"}\n',
    "files_sha256 not an object": '{"status": "complete", "files_sha256": ["a"]}\n',
    "not an object": "[1, 2]\n",
    "not JSON": "record of my shards\n",
}


@pytest.mark.parametrize("case", sorted(NOT_A_RUNS_RECORD))
@pytest.mark.parametrize("flag", ["--overwrite", "--resume"])
def test_a_record_no_run_wrote_is_refused(tmp_path, case, flag, refused_train):
    """Promise (bug: --overwrite emptied any directory holding a record.json): a record.json that is not a run's
    (not a JSON object of the record's types with a known status and a files_sha256 object) is refused by
    --overwrite and --resume alike; the shard and the subfolder beside it stay."""
    shards = tmp_path / "shards"
    (shards / "sub").mkdir(parents=True)
    (shards / "record.json").write_text(NOT_A_RUNS_RECORD[case])
    (shards / "shard-00000.parquet").write_bytes(b"PAR1\0rows")
    (shards / "sub" / "index.txt").write_text("0\n")
    before = tree_hash(shards)
    result = refused_train([f"hydra.run.dir={shards}", flag], cwd=tmp_path)
    assert_refused(result, "record.json is not a run's record", shards, before)


def _copy_run(planned: Path, tmp: Path) -> Path:
    import shutil

    run_dir = tmp / "run"
    shutil.copytree(planned, run_dir, symlinks=True)
    return run_dir


def _list_in_record(run_dir: Path, *names: str) -> None:
    """Add ``names`` to the run's files_sha256 (as a run that wrote them would have)."""
    import json

    record = json.loads((run_dir / "record.json").read_text())
    for name in names:
        record["files_sha256"][name] = hashlib.sha256((run_dir / name).read_bytes()).hexdigest()
    (run_dir / "record.json").write_text(json.dumps(record))


def _user_additions(run_dir: Path) -> str:
    (run_dir / "NOTES.md").write_text("what I learnt from this run\n")
    (run_dir / "checkpoint").mkdir()
    (run_dir / "checkpoint" / "iter_0000020.pt").write_bytes(b"weights")
    return "NOTES.md, checkpoint/"


def _unlisted_in_a_listed_folder(run_dir: Path) -> str:
    (run_dir / "extra").mkdir()
    (run_dir / "extra" / "listed.txt").write_text("the run wrote this\n")
    _list_in_record(run_dir, "extra/listed.txt")
    (run_dir / "extra" / "mine.txt").write_text("I added this\n")
    return "extra/mine.txt"


def _more_than_three(run_dir: Path) -> str:
    for name in ("a.txt", "b.txt", "c.txt", "d.txt"):
        (run_dir / name).write_text(name)
    return "(a.txt, b.txt, c.txt, ...)"


FOREIGN = {
    "notes and a checkpoint": _user_additions,
    "a file in a listed folder": _unlisted_in_a_listed_folder,
    "more than three": _more_than_three,
}


@pytest.mark.parametrize("case", sorted(FOREIGN))
def test_overwrite_refuses_a_run_with_files_of_others(planned, tmp_path, case, refused_train):
    """Promise (bug: --overwrite deleted a user's NOTES.md and checkpoint beside a run): --overwrite removes only
    what the run's record lists and what a run writes; a directory holding anything else is refused before
    anything is removed, naming up to three of those entries."""
    run_dir = _copy_run(planned, tmp_path)
    expected = FOREIGN[case](run_dir)
    before = tree_hash(run_dir)
    result = refused_train([f"hydra.run.dir={run_dir}", "--overwrite"], cwd=tmp_path)
    assert_refused(result, f"holds files its run's record.json does not list ({expected.strip('()')}", run_dir, before)


def test_overwrite_of_a_run_leaves_no_old_file(planned, tmp_path):
    """Promise: --overwrite of a genuine run still works: every file the old run wrote (its record's files, the
    launchers' and workers' names, logs/, probes/, data/) is gone and the directory holds the new plan only."""
    run_dir = _copy_run(planned, tmp_path)
    for name in (
        "logs/node-0.log",
        "probes/node-0.json",
        "data/rows/rows.jsonl",
        "probe-rank-0.json",
        "job.json",
        "attestation.json",
        "extra/deep/listed.txt",
    ):
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(f"old {name}\n")
    _list_in_record(run_dir, "extra/deep/listed.txt")
    old = {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    result = run_train([f"hydra.run.dir={run_dir}", "--overwrite"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    new = {str(p.relative_to(run_dir)) for p in run_dir.rglob("*")}
    fresh = {str(p.relative_to(planned)) for p in planned.rglob("*")} - {"metrics.jsonl"}
    assert new == fresh, new ^ fresh
    assert (run_dir / "record.json").read_bytes() != old["record.json"]


def test_overwrite_never_follows_a_link(planned, tmp_path):
    """Promise: a link among a run's names (``logs`` to a folder of the user's) is removed, never what it points
    to."""
    from trainer.record.rundir import claim_run_dir

    run_dir = _copy_run(planned, tmp_path)
    elsewhere = _user_dir(tmp_path)
    (run_dir / "logs").symlink_to(elsewhere, target_is_directory=True)
    before = tree_hash(elsewhere)
    claim_run_dir(str(run_dir), "overwrite")
    assert list(run_dir.iterdir()) == [] and tree_hash(elsewhere) == before


# ------------------------------------------------------------------------------------- --resume of the same composition


def test_the_composition_hash_is_the_same_for_the_same_command_line():
    """Promise: composing the same command line twice (from the cache or not, at another time) gives the same
    composition_sha256; another composition, or another value of a field, another one."""
    from trainer import launch
    from trainer.compose.compose import session
    from trainer.compose.prepare import prepare

    def digest(overrides, cached=True):
        with session(cached=cached) as composer:
            return prepare(overrides, composer, check_launcher=launch.check).record_fields()["composition_sha256"]

    same = {digest([]), digest([]), digest([], cached=False), digest(["hydra.run.dir=/elsewhere"])}
    assert len(same) == 1 and len(next(iter(same))) == 64
    assert digest(["layout=tp8pp8ep8"]) not in same and digest(["optim.lr=2e-5"]) not in same


def test_the_composition_hash_keeps_no_secret():
    """Promise: a secret's value does not change the composition hash (the hash of known text and a short secret
    would give it away): the hash is that of the composition as config.yaml records it, secrets redacted."""
    from trainer import launch
    from trainer.compose.prepare import prepare

    a = prepare(["+env.HF_TOKEN=hf_first_secret_1"], check_launcher=launch.check).record_fields()["composition_sha256"]
    b = prepare(["+env.HF_TOKEN=hf_other_secret_2"], check_launcher=launch.check).record_fields()["composition_sha256"]
    assert a == b


def _drop_composition(run_dir: Path) -> str:
    import json

    record = json.loads((run_dir / "record.json").read_text())
    del record["composition_sha256"]
    (run_dir / "record.json").write_text(json.dumps(record))
    return "composition sha256 none recorded"


RESUME_CASES = {
    # name: (change to the run (run_dir) -> expected, the command line's other overrides)
    "another layout": (lambda run_dir: "holds a run of another composition (composition sha256 ", ["layout=tp8pp8ep8"]),
    "another field": (lambda run_dir: "choose a new directory or --overwrite", ["optim.lr=3e-5"]),
    "a record without the hash": (_drop_composition, []),
}


@pytest.mark.parametrize("case", sorted(RESUME_CASES))
def test_resume_refuses_a_run_of_another_composition(planned, tmp_path, case, refused_train):
    """Promise (bug: --resume re-planned another composition beside the old run's metrics): --resume writes only
    into a run of the same composition (composition_sha256 of the record and of the command line equal); another
    or none recorded is refused, naming both hashes, and the run is left as it was."""
    import json

    run_dir = _copy_run(planned, tmp_path)
    change, overrides = RESUME_CASES[case]
    expected = change(run_dir)
    before = tree_hash(run_dir)
    result = refused_train([f"hydra.run.dir={run_dir}", *overrides, "--resume"], cwd=tmp_path)
    assert_refused(result, expected, run_dir, before)
    theirs = json.loads((run_dir / "record.json").read_text()).get("composition_sha256")
    assert theirs is None or theirs in result.stderr


def test_resume_of_the_same_command_line_keeps_the_run(planned, tmp_path):
    """Promise: --resume of the same command line still works: the plan is written again into the run, its
    metrics stay, and the record keeps the same composition hash."""
    import json

    run_dir = _copy_run(planned, tmp_path)
    theirs = json.loads((run_dir / "record.json").read_text())["composition_sha256"]
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    result = run_train([f"hydra.run.dir={run_dir}", "--resume"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics
    assert json.loads((run_dir / "record.json").read_text())["composition_sha256"] == theirs


# ------------------------------------------------------------------------------------------ bad values

BAD_VALUES = {
    "NaN learning rate": ("optim.lr=nan", "optim.lr must be a finite number (got nan)"),
    "infinite learning rate": ("optim.lr=inf", "optim.lr must be a finite number (got inf)"),
    "negative model size": ("model.hidden_size=-5", "model.hidden_size must be > 0 (got -5)"),
    "negative vocab": ("model.vocab_size=-1", "model.vocab_size must be > 0 (got -1)"),
    "NaN GPU memory": ("cluster.gpu_memory_gb=nan", "cluster.gpu_memory_gb must be a finite number (got nan)"),
    "negative price": ("cluster.usd_per_node_hour=-2.5", "cluster.usd_per_node_hour must be >= 0 (got -2.5)"),
    "zero peak FLOP/s": ("cluster.gpu_peak_bf16_flops=0", "cluster.gpu_peak_bf16_flops must be > 0 (got 0.0)"),
    "env name not a shell name": ("+env.A-B=1", "env.A-B: not a shell variable name"),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_bad_values_are_refused_before_anything_is_written(tmp_path, case, refused_train):
    """Promise: a value no run can have (NaN, infinite, negative, zero where a rate is needed, an env name a shell
    cannot export) is refused with one line naming the field; no run directory appears."""
    override, expected = BAD_VALUES[case]
    result = refused_train([f"hydra.run.dir={tmp_path / 'run'}", override], cwd=tmp_path)
    assert_refused(result, expected, tmp_path / "run", "absent")


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
