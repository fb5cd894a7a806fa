"""Secrets never reach a run directory, stdout or stderr: one rule for what is secret, one pass every byte goes through.

The rule for names (:func:`is_secret_name`) splits a name into words (``_``, ``-``, ``.`` and camelCase boundaries).
An environment-style name (no lower-case letter: ``HF_TOKEN``, ``GITHUB_PAT``, ``SSHPASS``) is secret when any word is
a secret word (``TOKEN``, ``KEY``, ``SECRET``, ``PASSWORD``, ``PAT``, ``CREDENTIALS``, ...) or ends with one of the long
ones (``HFTOKEN``, ``DBPASSWORD``). Any other name (a config key, a CLI flag, an HTTP header, a query parameter:
``hf_token``, ``HfToken``, ``--redis-password``, ``Api-Key``, ``Authorization``, ``access_token``) is secret when its
last word is: ``KEY`` only after ``API``, ``ACCESS``, ``SECRET``, ``PRIVATE``, ... (:data:`KEY_QUALIFIERS`; a bare
``key`` only as a query parameter, ``?key=``), so that ``input_key``, ``moe_token_dispatcher_type``,
``--metadata-key`` and an error's ``(key: optim.lr)`` stay readable.

Values are secret (:class:`Redactor`) when they are

* learnt: the value of an override or variable whose name is secret, *whole* (``+env.hf_token=V``, ``+env.X_KEY=$V``,
  a list ``[a,b]`` and each element, a value with spaces or newlines), and the secrets inside any override's or
  variable's value once Hydra's escaping and quoting are undone (:func:`override_parts`): URL user info
  (``scheme://user:password@``, the password may hold ``/ @ : ( ) '``), secret-named query or fragment parameters
  (``?token=``, ``#access_token=``), ``NAME=VALUE`` (``launcher.job=[x,HF_TOKEN\\=V]``), secret CLI flags
  (``--hf-token=V``, ``--hf-token V``, also as two list elements), HTTP headers (``Authorization: Bearer V``,
  ``Api-Key: V``), JSON (``{"Authorization": "Bearer V"}``). A learnt value is replaced in *every* serialisation:
  Hydra's escapes (``\\:``, ``\\=``, ``\\,``, ``\\'``), JSON's (``\\"``, ``\\uXXXX``), YAML's (folded lines,
  ``''``), the shell's (``'\\''``, ``'"'"'``) (:func:`serialised_pattern`). Values of :data:`MIN_LEARNED` characters
  or more are replaced wherever they occur; shorter ones (down to :attr:`Redactor.short`, 4 by default, numbers
  and YAML words such as ``true`` aside) only where they stand as a whole token (no letter or digit beside them);
* found in the text by the rule's patterns: the same forms (URL user info also when Hydra escaped it,
  ``https\\://u\\:pw@``), ``NAME: VALUE`` lines (with their folded continuation lines) and ``"NAME": "VALUE"``.
  A number or YAML word (``true``) under a config-style name is a count, not a secret (``active_per_token: 37``),
  and a shell reference (``"${HF_TOKEN:?...}"``) is kept.

In a script (text starting with ``#!``) a redaction outside quotes is written ``'<redacted>'``, so the script stays
valid shell. What is not recognised: a secret under a name without a secret word that is not in one of the forms,
a learnt value shorter than :attr:`Redactor.short` (4; 1 in error lines), an encoded secret (base64, URL
percent-encoding) unless it is learnt in that form.

A :class:`Redactor` is taught a run's secrets (its overrides, its ``env`` block and the caller's environment), then
frozen (:meth:`Redactor.freeze`): from then on it learns nothing from the text it scrubs, so a word that a file
happens to assign to a secret-named key is redacted there, by the pattern, and nowhere else. :func:`guarding` makes
every :func:`trainer.publish.atomic_write` under a run directory pass through it while the run lasts,
:func:`trainer.record.rundir.sweep` passes the files others wrote there (Hydra's ``.hydra/``, workers' logs) through
it once more, and :func:`redacted_streams` puts stdout and stderr behind it (:class:`RedactingStream`, line by
line), so that Hydra's and our own error lines and Hydra's log lines are redacted too.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

from trainer.errors import EX_SOFTWARE, PLACE_ERRNOS, internal_error_report, os_error_line

REDACTED = "<redacted>"

# A word equal to one of these makes a name secret (case-insensitive).
SECRET_WORDS = frozenset(
    {
        "TOKEN",
        "KEY",
        "APIKEY",
        "SECRET",
        "SECRETS",
        "PASSWORD",
        "PASSWD",
        "PASSPHRASE",
        "PASS",
        "PWD",
        "PAT",
        "CREDENTIAL",
        "CREDENTIALS",
        "CREDS",
        "AUTH",
        "AUTHORIZATION",
        "PRIVATE",
        "COOKIE",
        "SIG",
        "SIGNATURE",
        "JWT",
        "BEARER",
        "DSN",
        "OTP",
        "SSHPASS",
    }
)
# A word ending with one of these is secret too (``HFTOKEN``, ``GHAPIKEY``, ``DBPASSWORD``).
SECRET_SUFFIXES = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "APIKEY", "CREDENTIAL", "CREDENTIALS")
# In a name with lower-case letters, a last word KEY is secret only after one of these (``api_key``, ``X-Api-Key``,
# ``aws_secret_access_key``), not after others (``input_key``, ``metadata_key``, ``--sign-key``).
KEY_QUALIFIERS = frozenset(
    {
        "API",
        "ACCESS",
        "SECRET",
        "PRIVATE",
        "AUTH",
        "CLIENT",
        "MASTER",
        "ENCRYPTION",
        "SESSION",
        "SSH",
        "LICENSE",
        "ACCOUNT",
        "SERVICE",
        "SUBSCRIPTION",
        "DEPLOY",
        "HF",
        "WANDB",
        "OPENAI",
    }
)
# The shell's working-directory variables: PWD is a secret word (DB_PWD), these two are paths.
NOT_SECRET_VARIABLES = frozenset({"PWD", "OLDPWD"})

_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")


def name_words(name: str) -> list[str]:
    """The words of a name, upper-cased: ``hfAccess_TOKEN-2`` -> ``["HF", "ACCESS", "TOKEN", "2"]``."""
    return [w.upper() for part in re.split(r"[^A-Za-z0-9]+", name) for w in _WORD.findall(part)]


def _secret_word(word: str) -> bool:
    return word in SECRET_WORDS or (len(word) > 6 and word.endswith(SECRET_SUFFIXES))


def is_secret_name(name: str) -> bool:
    """True when a variable, key, flag, header or query parameter named ``name`` holds a secret (the module's rule).

    ``HF_TOKEN``, ``GITHUB_PAT``, ``SSHPASS``, ``aws_secret_access_key``, ``X-Amz-Signature``, ``hfToken``,
    ``hf_token``, ``--redis-password``, ``Api-Key`` are secret; ``PATH``, ``KEYBOARD``, ``TOKENIZER``, ``row_tokens``,
    ``input_key``, ``moe_token_dispatcher_type`` are not.
    """
    words = name_words(name)
    if not any(c.islower() for c in name):
        return any(_secret_word(w) for w in words)
    while words and words[-1].isdigit():
        words.pop()
    if not words:
        return False
    if words[-1] == "KEY":
        return len(words) > 1 and (words[-2] in KEY_QUALIFIERS or _secret_word(words[-2]))
    return _secret_word(words[-1])


# ------------------------------------------------------------------------------------------------ the patterns

_ESCAPED = r"\\."  # one of Hydra's escapes (\: \= \, \\ \' ...), or JSON's
_BARE = rf"(?:[^\s,'\"\\\]}}]|{_ESCAPED})+"  # an unquoted value: up to a space, comma, quote or closing bracket
_VALUE = rf"(?:'[^'\n]*'|\"(?:[^\"\\\n]|\\.)*\"|{_BARE})"
# scheme://user:password@ (the password up to the last @ of the word, so it may hold / @ : ( )), or scheme://token@;
# Hydra's escaped form too (https\://u\:pw@); matched from its "//" on (a literal the search skips to), the scheme
# before it checked by _SCHEME_END
_SCHEME = r"\b[A-Za-z][A-Za-z0-9+.-]*\\?:(?:\\?/){2}"
_URL_AT = re.compile(
    rf"//(?P<info>(?:[^\s/@:'\"<>\\]|\\[^:\s])*\\?:(?:[^\s'\"<>\\]|{_ESCAPED})*@"
    rf"|(?:[^\s/@:'\"<>\\]|{_ESCAPED})+@)"
)
_SCHEME_END = re.compile(r"(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]*\\*:\Z")  # any backslashes: repr doubles them
# in one value (learning): the password may hold quotes too
_URL_LAX = re.compile(rf"(?P<scheme>{_SCHEME})(?P<info>[^\s/@:]*\\?:\S*@|[^\s/@:]+@)")
_QUERY = re.compile(rf"(?P<head>[?&;#](?P<name>[A-Za-z0-9_.~-]+)\\?=)(?P<value>(?:[^&#\s'\"<>\\]|{_ESCAPED})*)")
# NAME=VALUE (shell, Hydra overrides: ``+env.HF_TOKEN=...``, list elements ``[x,HF_TOKEN\=V]``)
_ASSIGN = re.compile(
    rf"(?<![A-Za-z0-9_\\?&;#-])(?P<head>(?:[A-Za-z_][A-Za-z0-9_-]*\.)*(?P<name>[A-Za-z_][A-Za-z0-9_-]*)"
    rf"\\?=)(?P<value>{_VALUE})"
)
# --name=VALUE, --name VALUE, "--name", "VALUE" (JSON, Python lists), [--name,VALUE] (Hydra lists)
_FLAG = re.compile(
    rf"(?<![A-Za-z0-9_-])(?P<head>--?(?P<name>[A-Za-z][A-Za-z0-9_.-]*)"
    rf"(?:\\?=|[\"']?[ \t]*,\s*[\"']?|[ \t]+))(?!-)(?P<value>{_VALUE})"
)
# Name: [Bearer|Basic|Token] VALUE (HTTP headers, also inside a value: a capitalised name, Api-Key, X-Api-Key, or
# authorization in any case; prose such as "is a secret: set it" is no header)
_HEADER = re.compile(
    rf"(?<![A-Za-z0-9_-])(?P<name>[A-Z][A-Za-z0-9]*(?:-[A-Za-z0-9]+)*|(?i:authorization))[ \t]*\\?:[ \t]*"
    rf"(?:(?i:Bearer|Basic|Token|Digest|Negotiate)[ \t]+)?(?P<value>(?!//){_BARE})"
)
# NAME: VALUE (YAML; its more-indented continuation lines are part of the value, see _yaml_end)
_YAML = re.compile(
    r"(?m)^(?P<head>[ \t]*(?:-[ \t]+)?(?P<q>[\"']?)(?P<name>[A-Za-z_][A-Za-z0-9_.-]*)(?P=q):[ \t]+)"
    r"(?P<value>\S[^\n]*)"
)
_JSON = re.compile(r"(?P<head>\"(?P<name>[A-Za-z_][A-Za-z0-9_.-]*)\"\s*:\s*)(?P<value>\"(?:[^\"\\\n]|\\.)*\")")
# a JSON object inside a JSON string: \"NAME\": \"VALUE\"
_JSON_IN_JSON = re.compile(r"\\\"(?P<name>[A-Za-z_][A-Za-z0-9_.-]*)\\\"\s*:\s*\\\"(?P<value>(?:[^\"\\]|\\[^\"])*)\\\"")
_NAMED = (_QUERY, _ASSIGN, _FLAG, _HEADER, _JSON, _JSON_IN_JSON)

# values shorter than this are replaced only where they stand as a whole token (:attr:`Redactor.short`)
MIN_LEARNED = 8
# a shell reference, not a value: $NAME, ${NAME}, ${NAME:?message}
_REFERENCE = re.compile(r"\$(?:[A-Za-z_][A-Za-z0-9_]*|\{[A-Za-z_][A-Za-z0-9_]*(?:[:?+=-][^}]*)?\})")
_PLAIN_SCALAR = re.compile(r"(?i)[-+]?[0-9._]*[0-9][0-9._e+-]*|true|false|null|none|yes|no|on|off|nan|inf")


def _unquote(value: str) -> str:
    if len(value) > 1 and value[0] in "'\"" and value[-1] == value[0]:
        return value[1:-1]
    return value


def unescape(text: str) -> str:
    """``text`` with Hydra's (and JSON's simple) backslash escapes undone: ``https\\://u\\:pw`` -> ``https://u:pw``."""
    return re.sub(r"\\(.)", r"\1", text, flags=re.S)


def _skip(value: str) -> bool:
    """A found value that is no secret: empty, already redacted, or a shell reference (``"${HF_TOKEN:?...}"``)."""
    bare = _unquote(value.strip())
    return not bare or REDACTED in bare or bool(_REFERENCE.fullmatch(bare))


def _char_pattern(c: str) -> str:
    """The ways one character of a secret may be written: itself, JSON's ``\\uXXXX``, YAML's ``\\xXX``, a quote the
    shell or YAML doubled, each after any backslashes (Hydra's and JSON's escapes)."""
    alts = []
    if c == "'":
        alts += [r"'\\''", "'\"'\"'", "''"]
    o = ord(c)
    if o < 0x20 or o >= 0x7F:
        if o > 0xFFFF:
            hi, lo = 0xD800 + ((o - 0x10000) >> 10), 0xDC00 + ((o - 0x10000) & 0x3FF)
            alts.append(rf"(?i:\\u{hi:04x}\\u{lo:04x})")
        else:
            alts.append(rf"(?i:\\u{o:04x})")
        if o < 0x100:
            alts.append(rf"(?i:\\x{o:02x})")
        if 0xDC80 <= o <= 0xDCFF:  # a byte that is not UTF-8 (surrogateescape)
            alts.append(rf"(?i:\\x{o - 0xDC00:02x})")
    alts.append(re.escape(c))
    return r"\\*(?:" + "|".join(alts) + ")"


_GAP = r"(?:\s|\\[ntr]|\\)+"  # where the value has white space: any white space, folded lines, \n escapes


def serialised_pattern(value: str, bounded: bool) -> str:
    """A regular expression for ``value`` however it was serialised (see the module docstring); ``bounded``: only
    as a whole token (no letter or digit before or after it)."""
    tokens = value.split()
    body = _GAP.join("".join(_char_pattern(c) for c in token) for token in tokens)
    return rf"(?<![A-Za-z0-9]){body}(?![A-Za-z0-9])" if bounded else body


def _anchor(value: str) -> str | None:
    """The longest run of letters and digits of ``value`` (never escaped by any serialisation): text without it
    cannot hold ``value``."""
    runs = re.findall(r"[A-Za-z0-9]+", value)
    return max(runs, key=len) if runs else None


class Redactor:
    """Replaces secrets in text with ``<redacted>``: values it was taught (:meth:`learn_env`, :meth:`learn_overrides`,
    :meth:`learn_secret`, and every value a pattern found before it was frozen), then the patterns of the module's
    rule. ``short``: the shortest value learnt (4; 1 for one error line, where a whole token of one character
    may be replaced). Linear in the text's length (a learnt value is looked for only where its longest run of
    letters and digits occurs)."""

    def __init__(self, short: int = 4) -> None:
        self.known: set[str] = set()
        self.frozen = False
        self.short = short
        self._compiled: dict[str, tuple[str | None, re.Pattern[str]]] = {}

    def freeze(self) -> Redactor:
        """Stop learning: later :meth:`scrub` calls redact what the patterns find in place but add no value to
        :attr:`known` (the run's secrets come from its overrides and environment, never from files)."""
        self.frozen = True
        return self

    def teach(self, other: Redactor) -> Redactor:
        """Add the values ``other`` knows (also to a frozen redactor: the caller vouches for them)."""
        self.known |= other.known
        return self

    def _keep(self, value: str) -> None:
        value = value.strip().strip("'\"")  # learnt without quotes at its ends (JSON and YAML keep their own)
        if self.frozen or not value or len(value) < self.short or len(value) >= MIN_LEARNED and value in REDACTED:
            return
        if len(value) < MIN_LEARNED and self.short > 1 and _PLAIN_SCALAR.fullmatch(value):
            return  # a number or a YAML word everywhere would be replaced in every JSON and YAML file
        self.known.add(value)

    def learn_secret(self, value: Any) -> Redactor:
        """Learn ``value`` whole, as a secret (one that is secret because of its name): a string, and its lines;
        each string of a list or mapping."""
        for text in _strings(value):
            self._keep(text)
            self._keep(_unquote(text.strip()))
            for line in text.splitlines():
                self._keep(line)
        return self

    def learn_value(self, value: Any) -> Redactor:
        """Learn the secrets inside ``value`` (any string of it): what the rule's patterns find, a URL password
        holding quotes, and the argument after a secret flag in a list (``[x, --hf-token, V]``)."""
        for items in _lists(value):
            for flag, following in zip(items, items[1:], strict=False):  # each element with the one after it
                if (
                    isinstance(flag, str)
                    and re.fullmatch(r"--?[A-Za-z][A-Za-z0-9_.-]*", flag)
                    and is_secret_name(flag.lstrip("-"))
                    and isinstance(following, str)
                ):
                    self.learn_secret(following)
        for name, text in _named_strings(value):
            if name is not None and is_secret_name(name):
                self.learn_secret(text)
            for m in _URL_LAX.finditer(text):
                info = m.group("info")[:-1]
                user, colon, password = unescape(info).partition(":")
                self._keep(password if colon else user)
            self._spans(text, learn=True)
            if text != unescape(text):
                self._spans(unescape(text), learn=True)
        return self

    def learn_env(self, env: Mapping[str, object]) -> Redactor:
        """Learn the values of the secret-named variables of an environment (the run's ``env`` block, the caller's
        environment; ``PWD`` and ``OLDPWD`` are paths), and the secrets inside every value (``CUSTOM_HEADERS``
        holding ``{"Authorization": "Bearer V"}``, a URL with a password)."""
        for name, value in env.items():
            if value is None or str(name) in NOT_SECRET_VARIABLES:
                continue
            if is_secret_name(str(name)):
                self.learn_secret(value)
            self.learn_value(value)
        return self

    def learn_overrides(self, overrides: Iterable[str]) -> Redactor:
        """Learn the secret values of Hydra overrides as Hydra reads them (:func:`override_parts`): the whole value of
        one that sets a secret-named key (``+env.hf_token=...``; each value of a sweep or list, and the value as
        typed), and the secrets inside every value (URLs with credentials, ``NAME=VALUE`` and secret flags in a
        list, headers)."""
        for word in overrides:
            key, value, typed = override_parts(word)
            if key is not None and is_secret_name(key.rsplit(".", 1)[-1]):
                self.learn_secret(value)
                self.learn_secret(typed)
            self.learn_value(value)
            self.learn_value(typed)
        return self

    # ------------------------------------------------------------------------------------------- scrubbing

    def _pattern(self, value: str) -> tuple[str | None, re.Pattern[str]]:
        if value not in self._compiled:
            bounded = len(value) < MIN_LEARNED or value.isdigit()
            self._compiled[value] = (_anchor(value), re.compile(serialised_pattern(value, bounded)))
        return self._compiled[value]

    def _spans(self, text: str, learn: bool = False) -> list[tuple[int, int]]:
        """The spans of ``text`` to replace (merged, sorted): the rule's patterns, then the known values. With
        ``learn`` (and not frozen), the values the patterns find are learnt first."""
        spans: list[tuple[int, int]] = []

        def found(start: int, end: int, value: str, name: str) -> None:
            if _skip(value) or _PLAIN_SCALAR.fullmatch(value) and any(c.islower() for c in name):
                return  # a number or YAML word under a config-style name: a count (active_per_token: 37)
            if len(value) > 1 and value[0] in "'\"" and value[-1] == value[0]:
                start, end, value = start + 1, end - 1, value[1:-1]
            spans.append((start, end))
            if learn:
                self._keep(unescape(value))

        for m in _URL_AT.finditer(text):
            info = m.group("info")[:-1]
            if _SCHEME_END.search(text, max(0, m.start() - 64), m.start()) and not _skip(info):
                spans.append((m.start("info"), m.end("info") - 1))
                if learn:
                    user, colon, password = unescape(info).partition(":")
                    self._keep(password if colon else user)
        for start, end in _name_windows(text):
            for pattern in _NAMED:
                for m in pattern.finditer(text, start, end):
                    if is_secret_name(m.group("name")) or pattern is _QUERY and m.group("name").lower() == "key":
                        found(m.start("value"), m.end("value"), m.group("value"), m.group("name"))
            for m in _YAML.finditer(text, start, end):
                if is_secret_name(m.group("name")):
                    if m.group("q") == '"':  # a pretty-printed JSON line: "name": value, (a list or object: its
                        if m.group("value")[:1] in "[{":  # strings are found by the other patterns)
                            continue
                        stop = m.end("value") - (1 if m.group("value").endswith(",") else 0)
                    else:
                        stop = _yaml_end(text, m)
                    found(m.start("value"), stop, text[m.start("value") : stop], m.group("name"))
        for value in sorted(self.known, key=len, reverse=True):
            anchor, pattern = self._pattern(value)
            for start, end in _windows(text, [anchor] if anchor else None, 8 * len(value) + 64, 8 * len(value) + 64):
                spans += [m.span() for m in pattern.finditer(text, start, end) if m.end() > m.start()]
        return _merge(spans)

    def scrub(self, text: str) -> str:
        """``text`` with every secret replaced by ``<redacted>``; values the patterns find are learnt (unless
        frozen). In a script (a text starting with ``#!``), a redaction outside quotes is written
        ``'<redacted>'``, so that the script stays valid shell (``--redis-password='<redacted>'``)."""
        spans = self._spans(text, learn=not self.frozen)
        if text.startswith("#!") and spans:
            return _apply(text, spans, _unquoted_in_shell(text, [start for start, _ in spans]))
        return _apply(text, spans)

    def scrub_bytes(self, data: bytes) -> bytes:
        """:meth:`scrub` on bytes (NUL bytes and bytes that are not UTF-8 included: they round-trip unchanged)."""
        return self.scrub(data.decode("utf-8", "surrogateescape")).encode("utf-8", "surrogateescape")


# every secret name holds one of these (lower-cased): where none occurs, no named pattern is tried
_STEMS = (
    "token",
    "key",
    "secret",
    "pass",
    "pwd",
    "pat",
    "cred",
    "auth",
    "private",
    "cookie",
    "sig",
    "jwt",
    "bearer",
    "dsn",
    "otp",
)


def _windows(
    text: str,
    needles: Sequence[str] | None,
    before: int,
    after: int,
    lowered: str | None = None,
    lines: bool = False,
) -> list[tuple[int, int]]:
    """The parts of ``text`` around each occurrence of a needle (``before`` characters before it, ``after`` after
    it; with ``lines``, from the start of its line when that is nearer, to the end of the line after it when that
    is nearer), merged; the whole text when ``needles`` is None. ``lowered``: the text to look in (same length)."""
    if needles is None:
        return [(0, len(text))]
    haystack = text if lowered is None else lowered
    hits = []
    for needle in needles:
        at = haystack.find(needle)
        while at >= 0:
            hits.append(at)
            at = haystack.find(needle, at + len(needle))
    out: list[tuple[int, int]] = []
    for at in sorted(hits):
        start, end = max(at - before, 0), min(at + after, len(text))
        if lines:
            start = max(text.rfind("\n", 0, at) + 1, start)
            stop = text.find("\n", at)
            stop = text.find("\n", stop + 1) if stop >= 0 else -1
            end = min(len(text) if stop < 0 else stop, end)
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _name_windows(text: str) -> list[tuple[int, int]]:
    """Where a secret name may stand in ``text``: around the :data:`_STEMS` (a name is at most 256 characters
    before its stem, a value on its line or the next, at most :data:`OVERLAP` characters)."""
    lowered = text.replace("\u0130", "I").lower()  # U+0130 is the one character whose lower case is two
    if len(lowered) != len(text):  # (never: a guard for another Unicode version) look everywhere
        return [(0, len(text))]
    return _windows(text, _STEMS, 256, OVERLAP, lowered, lines=True)


def _yaml_end(text: str, m: re.Match[str]) -> int:
    """Where the YAML value of ``m`` ends: after its line and the lines below that are indented more than its key
    (a folded plain or quoted scalar, a block scalar's lines; blank lines between them), trailing blanks left out."""
    line_start = text.rfind("\n", 0, m.start()) + 1
    column = m.start("name") - line_start - (1 if m.group("q") else 0)
    end = m.end("value")
    pos = end
    while pos < len(text) and text[pos] == "\n":
        nxt = text.find("\n", pos + 1)
        line = text[pos + 1 : nxt if nxt >= 0 else len(text)]
        if line.strip():
            indent = len(line) - len(line.lstrip(" \t"))
            if indent <= column:
                break
            end = pos + 1 + len(line)
        pos = nxt if nxt >= 0 else len(text)
    while end > m.start("value") and text[end - 1] in " \t\r":
        end -= 1
    return end


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _unquoted_in_shell(text: str, positions: Sequence[int]) -> set[int]:
    """Those of ``positions`` (sorted) of the shell script ``text`` that are outside quotes and comments."""
    out, wanted, state, i, n = set(), list(positions), "", 0, len(text)
    k = 0
    while i < n and k < len(wanted):
        while k < len(wanted) and wanted[k] <= i:
            if wanted[k] == i and not state:
                out.add(i)
            k += 1
        c = text[i]
        if state == "'":
            state = "" if c == "'" else state
        elif state == '"':
            if c == "\\":
                i += 1
            elif c == '"':
                state = ""
        elif c == "\\":
            i += 1
        elif c in "'\"":
            state = c
        elif c == "#" and (i == 0 or text[i - 1] in " \t\n;"):
            stop = text.find("\n", i)
            i = n if stop < 0 else stop
            continue
        i += 1
    return out


def _apply(text: str, spans: Sequence[tuple[int, int]], quoted: AbstractSet[int] = frozenset()) -> str:
    """``text`` with each span replaced by ``<redacted>`` (by ``'<redacted>'`` where it starts at one of ``quoted``)."""
    parts, last = [], 0
    for start, end in spans:
        parts += [text[last:start], f"'{REDACTED}'" if start in quoted else REDACTED]
        last = end
    parts.append(text[last:])
    return "".join(parts)


def _strings(value: Any) -> Iterator[str]:
    """Every string of ``value`` (a string, a list, a mapping's keys and values, a Hydra sweep's values)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, (list, tuple, set)):
        for v in value:
            yield from _strings(v)
    elif hasattr(value, "list") and isinstance(value.list, list):  # ChoiceSweep
        yield from _strings(value.list)
    elif hasattr(value, "include"):  # Glob
        yield from _strings(list(value.include) + list(getattr(value, "exclude", [])))


def _named_strings(value: Any, name: str | None = None) -> Iterator[tuple[str | None, str]]:
    """(the key it is under or None, string) for every string of ``value``."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _named_strings(v, str(k))
    elif isinstance(value, str):
        yield name, value
    else:
        for text in _strings(value):
            yield name, text


def _lists(value: Any) -> Iterator[list]:
    if isinstance(value, (list, tuple)):
        yield list(value)
        for v in value:
            yield from _lists(v)
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _lists(v)
    elif hasattr(value, "list") and isinstance(value.list, list):
        yield from _lists(value.list)


def override_parts(word: str) -> tuple[str | None, Any, str]:
    """(key, value, the value as typed) of a Hydra override as Hydra reads it: quotes and escapes undone, a list or
    sweep as its values (``+env.A=[x,'--hf-token=V']`` -> ``("env.A", ["x", "--hf-token=V"], "[x,'--hf-token=V']")``).
    An override Hydra cannot parse (an unterminated quote) gives its key as typed and its value as typed, with
    the quotes and escapes also undone; a word without ``=`` gives (None, word, word)."""
    key, sep, typed = word.partition("=")
    if not sep:
        return None, word, word
    key = key.strip().lstrip("+~").strip()
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        parsed = OverridesParser.create().parse_override(word)
        value = parsed._value if parsed.is_sweep_override() else parsed.value()
        return parsed.key_or_group, value, typed
    except Exception:  # noqa: BLE001 - any parse failure: the value as typed
        return key, [typed, typed.strip().strip("'\""), unescape(typed)], typed


def redact_value(value: str) -> str:
    """``value`` with URL credentials, secret query values, secret ``NAME=VALUE``, flag and header values replaced
    (the secrets found in it are replaced wherever else ``value`` holds them)."""
    return Redactor(short=1).learn_value(value).scrub(value)


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``env`` sorted by name: secret-named variables become ``<redacted>``, other values lose the secrets
    inside them (:func:`redact_value`)."""
    return {name: (REDACTED if is_secret_name(name) else redact_value(value)) for name, value in sorted(env.items())}


def sets_secret(word: str) -> bool:
    """Whether the ``NAME=VALUE`` word (a Hydra override, ``+env.HF_TOKEN=...``) sets a secret-named key: the last
    dotted part of NAME, less Hydra's ``+``/``~`` prefixes, by :func:`is_secret_name`."""
    key, sep, _ = word.partition("=")
    return bool(sep) and is_secret_name(key.strip().lstrip("+~").strip().rsplit(".", 1)[-1])


def redact_override(word: str) -> str:
    """One override as an error line or a record may show it: ``KEY=<redacted>`` when it sets a secret-named key,
    else the override with the secrets inside its value replaced."""
    if sets_secret(word):
        return f"{word.partition('=')[0]}={REDACTED}"
    return Redactor(short=1).learn_overrides([word]).scrub(word)


def redact_argv(argv: Iterable[str]) -> list[str]:
    """A command line with each word redacted (:func:`redact_override`)."""
    return [redact_override(word) for word in argv]


# ------------------------------------------------------------------------------------------------ streams


class RedactingStream:
    """A text stream (stdout, stderr) whose every line passes through a redactor before it reaches ``stream``.
    Text is held until its line ends (or :meth:`flush`, or 64 KiB are held), so a secret is never split across
    two scrubs of one line. An ``OSError`` of the place behind the stream (a full disk behind ``> file``,
    ``/dev/full``: :data:`trainer.errors.PLACE_ERRNOS`) does not stop the program: it is kept in :attr:`failed`,
    named ``name`` (``standard output``), and what is written later is dropped (:func:`redacted_streams` then
    ends the command with that one line); any other ``OSError`` propagates."""

    HOLD = 64 << 10

    def __init__(self, stream: Any, redactor: Redactor, name: str = "") -> None:
        self.stream = stream
        self.redactor = redactor
        self.name = name
        self.failed: OSError | None = None
        self._held = ""

    def _emit(self, text: str, flush: bool = False) -> None:
        if self.failed is not None:
            return
        try:
            if text:
                self.stream.write(self.redactor.scrub(text))
            if flush:
                self.stream.flush()
        except OSError as err:
            if err.filename is None and self.name:
                err.filename = self.name
            if err.errno not in PLACE_ERRNOS:
                raise
            self.failed = err

    def write(self, text: str) -> int:
        self._held += text
        if "\n" in text or len(self._held) > self.HOLD:
            head, newline, self._held = self._held.rpartition("\n")
            if not newline:
                head, self._held = self._held, ""
            self._emit(head + newline)
        return len(text)

    def flush(self) -> None:
        held, self._held = self._held, ""
        self._emit(held, flush=True)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:  # encoding, fileno, isatty, buffer ...
        return getattr(self.stream, name)


@contextlib.contextmanager
def redacted_streams(redactor: Redactor, errors: Redactor | None = None) -> Iterator[Redactor]:
    """stdout and stderr behind ``redactor`` (:class:`RedactingStream`) for the time of the block. An exception
    that is not an exit is a bug: one line ``train: internal error: TYPE: MESSAGE (...)``
    (:func:`trainer.errors.internal_error_line`, passed through ``errors`` too, the redactor of error lines;
    ``TRAINER_DEBUG=1``: after its traceback) and exit 70; an ``OSError`` of the place
    (:data:`trainer.errors.PLACE_ERRNOS`: standard output on a full disk) is one line and exit 2, another
    ``OSError`` its traceback (redacted) and exit 1; Ctrl-C exits 130."""
    import traceback

    saved = sys.stdout, sys.stderr
    out = sys.stdout = RedactingStream(saved[0], redactor, "standard output")
    sys.stderr = RedactingStream(saved[1], redactor, "standard error")

    def output_lost(code: Any) -> None:  # standard output could not be written: say so, once, on stderr
        try:
            out.flush()
        except (OSError, ValueError):
            pass
        if out.failed is not None:
            failed, out.failed = out.failed, None
            saved[1].write(f"train: error: {redactor.scrub(os_error_line(failed))}\n")
            try:  # what stays in its buffer would fail again at exit (exit status 120): it goes nowhere now
                import os

                os.dup2(os.open(os.devnull, os.O_WRONLY), saved[0].fileno())
            except (OSError, ValueError):
                pass
            raise SystemExit(code or 2) from None

    try:
        yield redactor
        output_lost(0)
    except SystemExit as ending:
        output_lost(ending.code)
        raise
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except OSError as err:
        if err.errno not in PLACE_ERRNOS:
            sys.stderr.write("".join(traceback.format_exc()))
            raise SystemExit(1) from None
        _last_words(f"train: error: {redactor.scrub(os_error_line(err))}")
        raise SystemExit(2) from None
    except Exception as err:  # noqa: BLE001 - a bug: one line (its traceback with TRAINER_DEBUG=1), redacted
        report = internal_error_report("train", err)
        sys.stderr.write(errors.scrub(report) if errors is not None else report)
        raise SystemExit(EX_SOFTWARE) from None
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        sys.stdout, sys.stderr = saved


def _last_words(line: str) -> None:
    """Print ``line`` on stderr, ignoring a stderr that cannot be written either."""
    try:
        print(line, file=sys.stderr)
    except (OSError, ValueError):
        pass


# ------------------------------------------------------------------------------------------------ files

# The run directories being written now, each with its run's redactor (:func:`guarding`): an entry lives as long
# as its run, never longer, so one run's secrets never scrub, nor its directory capture, another run's files.
_GUARDED: dict[Path, Redactor] = {}


@contextlib.contextmanager
def guarding(directory: Path, redactor: Redactor) -> Iterator[Redactor]:
    """For the time of the block, every :func:`trainer.publish.atomic_write` under ``directory`` is scrubbed by
    ``redactor`` (:func:`redactor_for`); when the block ends, however it ends, ``directory`` is guarded by what
    guarded it before (nothing, for a run's directory)."""
    key = Path(directory).absolute()
    before = _GUARDED.get(key)
    _GUARDED[key] = redactor
    try:
        yield redactor
    finally:
        if before is None:
            _GUARDED.pop(key, None)
        else:
            _GUARDED[key] = before


def redactor_for(path: Path) -> Redactor | None:
    """The redactor guarding ``path``'s directory (or one above it) now (:func:`guarding`), or None."""
    path = Path(path).absolute()
    for directory, redactor in _GUARDED.items():
        if path == directory or directory in path.parents:
            return redactor
    return None


# A large file is scrubbed in chunks (trainer.record.rundir.scrub_file), each with this many characters after
# it in view; a secret is searched for in windows of this many characters around a secret-named key
OVERLAP = 1 << 20


def scrub_data(value: Any, redactor: Redactor) -> Any:
    """A copy of JSON-like ``value`` with every string (keys too) passed through ``redactor``: what is signed or
    serialised afterwards holds no secret, in whatever encoding it is then written (base64 in a DSSE envelope)."""
    if isinstance(value, str):
        return redactor.scrub(value)
    if isinstance(value, Mapping):
        return {scrub_data(k, redactor): scrub_data(v, redactor) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrub_data(v, redactor) for v in value]
    return value


def redact_field(name: str, value: object) -> str:
    """``value`` of the field or variable ``name`` as an error line may show it: ``<redacted>`` when ``name`` is
    secret (its last dotted part, :func:`is_secret_name`), else with the secrets inside it replaced
    (:func:`redact_value`). Checks name the field, say what was expected and show only this."""
    if is_secret_name(str(name).rsplit(".", 1)[-1].split("[")[0]):
        return REDACTED
    return redact_value(str(value))


def redact_error(message: str, overrides: Iterable[str]) -> str:
    """An error line about ``overrides`` with their secrets replaced, however short (a value Hydra or OmegaConf
    repeats: ``Cannot convert 'list' to string: '['V', 'b']'``, ``The value of 'env.HF_TOKEN' is ...``)."""
    redactor = Redactor(short=1).learn_overrides(list(overrides))
    for value in list(redactor.known):  # Hydra's lexer repeats the input from a quote on: the pieces between quotes
        for piece in re.split(r"['\"]", value):
            redactor._keep(piece)
    return redactor.freeze().scrub(message)
