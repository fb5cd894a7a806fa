"""Fuzzing the parsers with hypothesis: whatever the bytes, a parser returns a value or raises one UserError line.

Bounded for CI: a fixed number of examples per property, derandomized (the same examples every run), no example
database, no deadline (the machine is shared).
"""

import json
import string

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import helpers
from trainer.errors import UserError
from trainer.inputs import parse_json, parse_yaml
from trainer.lock.imagelock import validate_lock
from trainer.record.rundir import check_record_types
from trainer.redact import Redactor
from trainer.report.logs import parse_log
from trainer.report.metrics import read_metrics

BOUNDED = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=30,
)
# text that looks like the formats: their own punctuation mixed with random characters and lone surrogates
json_like = st.lists(
    st.sampled_from(list('{}[]":,0123456789.eE-+ \\u') + ["\ud800", "é", "\n", "null", "NaN", "1" * 5000]), max_size=200
).map("".join)
yaml_like = st.lists(
    st.sampled_from(list("&*!|>-:?[]{},#'\" \n\tab01.") + ["!!python/object", "<<", "\ud800", "&a", "*a"]), max_size=200
).map("".join)


def one_line(err: UserError) -> None:
    assert str(err) and "\n" not in str(err)


@BOUNDED
@given(json_like)
def test_json_parser_returns_or_refuses_in_one_line(text):
    """Promise: parse_json gives a value or one UserError line, whatever the text."""
    try:
        parse_json(text, "fuzz")
    except UserError as err:
        one_line(err)


@BOUNDED
@given(yaml_like)
def test_yaml_parser_returns_or_refuses_in_one_line(text):
    """Promise: parse_yaml (safe, bounded) gives a value or one UserError line; it never builds Python objects."""
    try:
        parse_yaml(text, "fuzz")
    except UserError as err:
        one_line(err)


@BOUNDED
@given(
    st.lists(
        st.one_of(
            json_like,
            json_values.map(json.dumps),
            st.fixed_dictionaries({"step": st.integers(), "lm_loss": st.floats()}).map(json.dumps),
        ),
        max_size=8,
    )
)
def test_metrics_reader_returns_or_refuses_in_one_line(tmp_path_factory, lines):
    """Promise: read_metrics gives steps (strictly increasing, numbers) or one UserError line naming the line."""
    path = tmp_path_factory.mktemp("m") / "metrics.jsonl"
    path.write_bytes("\n".join(lines).encode("utf-8", "surrogatepass"))
    try:
        steps = read_metrics(path)
    except UserError as err:
        one_line(err)
    else:
        assert all(a.step < b.step for a, b in zip(steps, steps[1:], strict=False))


log_line = st.one_of(
    st.builds(
        lambda i, t, loss: f" iteration {i}/ 20 | elapsed time per iteration (ms): {t} | lm loss: {loss} |",
        st.integers(-5, 10**20),
        st.floats() | st.text(max_size=5),
        st.floats() | st.text(max_size=5),
    ),
    st.text(max_size=80),
    st.builds(lambda d: f"step {d}", json_values.map(repr)),
)


@BOUNDED
@given(st.lists(log_line, max_size=10))
def test_log_reader_returns_or_refuses_in_one_line(lines):
    """Promise: parse_log gives steps or one UserError line, whatever the log holds."""
    try:
        parse_log("\n".join(lines), "fuzz.log")
    except UserError as err:
        one_line(err)


@BOUNDED
@given(
    json_values
    | st.dictionaries(
        st.sampled_from(
            [
                "schema_version",
                "kind",
                "name",
                "epoch",
                "base",
                "wheels",
                "sources",
                "image",
                "python",
                "platform",
                "bundle",
            ]
        ),
        json_values,
        max_size=11,
    )
)
def test_lock_validation_refuses_in_one_line(lock):
    """Promise: validate_lock accepts a lock or raises one UserError line naming the field, for any JSON value."""
    try:
        validate_lock(lock, "fuzz.lock.json")
    except UserError as err:
        one_line(err)


@BOUNDED
@given(
    st.dictionaries(
        st.sampled_from(["status", "pid", "probe", "slurm", "times", "files_sha256", "host"]), json_values, max_size=7
    )
)
def test_record_types_are_checked_in_one_line(record):
    """Promise: a record's known fields have their JSON types or the record is refused in one line."""
    try:
        check_record_types(record, "record.json")
    except UserError as err:
        one_line(err)


secret_values = st.text(alphabet=string.ascii_letters + string.digits + "/@+=_-%.~!$&()*", min_size=8, max_size=40)


@BOUNDED
@given(
    secret_values,
    st.sampled_from(
        [
            "+env.HF_TOKEN={s}",
            "export GITHUB_PAT={s}",
            "  MY_API_KEY: {s}",
            '  "DB_PASSWORD": "{s}"',
            "https://user:{s}@host.example/x",
            "https://host.example/x?access_token={s}",
        ]
    ),
)
def test_redaction_removes_a_secret_in_every_form(secret, form):
    """Promise: a secret in any of the forms of the rule leaves no trace after one scrub."""
    if form.startswith("https://user:"):
        secret = secret.replace("@", "")  # a password's @ is only known to end at the host's @
    text = form.format(s=secret)
    out = Redactor().scrub(text)
    assert secret not in out and "<redacted>" in out, (text, out)


# secret forms: a value with quotes, colons, brackets, $ and spaces, under a lower-, mixed- or upper-case secret name
secret_form_values = st.text(
    alphabet=string.ascii_letters + string.digits + "'\":()@$ /=,\\", min_size=8, max_size=30
).filter(lambda s: s.strip() == s and any(c.isalnum() for c in s))


@BOUNDED
@given(
    secret_form_values,
    st.sampled_from(["hf_token", "HfToken", "HF_TOKEN", "db_password", "X-Api-Key"]),
    st.sampled_from(["+", "++", ""]),
)
def test_a_learnt_secret_of_any_form_leaves_no_trace(secret, name, prefix):
    """Promise: a secret-named override's value, whatever characters it holds, is replaced in Hydra's stored form,
    YAML, JSON and the shell's quoting of it (the serialisations a run directory holds)."""
    import shlex

    import yaml
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from trainer.compose.commandline import quote_override_value

    override = f"{prefix}env.{name}={quote_override_value(secret)}"
    parsed = OverridesParser.create().parse_override(override)
    assert parsed.value() == secret
    redactor = Redactor().learn_overrides([override]).freeze()
    for text in (
        f"{parsed.key_or_group}={parsed.get_value_element_as_str()}",
        yaml.safe_dump({name: secret}),
        json.dumps({name: secret}),
        json.dumps([secret], ensure_ascii=True),
        shlex.quote(secret),
        repr([override]),
    ):
        out = redactor.scrub(text)
        assert secret not in out and "<redacted>" in out, (text, out)


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
