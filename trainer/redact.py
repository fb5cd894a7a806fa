"""Secrets never reach a run directory: one rule for what looks secret, one pass every written file goes through.

The rule (:func:`is_secret_name`) splits a name into words (``_``, ``-``, ``.`` and camelCase boundaries) and calls it
secret when a word is a secret word (``TOKEN``, ``KEY``, ``SECRET``, ``PASSWORD``, ``PAT``, ``CREDENTIALS``, ...) or
ends with one of the long ones (``HFTOKEN``, ``APIKEY``). Values are secret when they are the password or token part
of a URL (``scheme://user:password@host``, the password may hold ``/`` or ``@``), the value of a secret-named query
parameter (``?token=...``, ``&X-Amz-Signature=...``), or the value of a secret-named variable (``HF_TOKEN=...``,
``HF_TOKEN: ...``, ``"HF_TOKEN": "..."``).

A :class:`Redactor` learns the secret values of a run (its overrides and its ``env`` block) and replaces them, and
everything the patterns find, with ``<redacted>`` in any text. Once taught, it is frozen (:meth:`Redactor.freeze`):
from then on it learns nothing from the text it scrubs, so a word that a file happens to assign to a secret-named
key (``password=password`` in a library's source) is redacted there, by the pattern, and nowhere else.
:func:`guard` makes every :func:`trainer.publish.atomic_write` under a run directory pass through it, and
:func:`sweep` passes the files others wrote there (Hydra's ``.hydra/``, workers' logs) through it once more, except
the folders it is told are verbatim copies of content verified by digest (a run's ``image/``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Set

REDACTED = "<redacted>"

# A word equal to one of these makes a name secret (case-insensitive).
SECRET_WORDS = frozenset({
    "TOKEN", "KEY", "APIKEY", "SECRET", "SECRETS", "PASSWORD", "PASSWD", "PASSPHRASE", "PASS", "PWD",
    "PAT", "CREDENTIAL", "CREDENTIALS", "CREDS", "AUTH", "AUTHORIZATION", "PRIVATE", "COOKIE", "SIG", "SIGNATURE",
    "JWT", "BEARER", "DSN", "OTP",
})
# A word ending with one of these is secret too (``HFTOKEN``, ``GHAPIKEY``, ``DBPASSWORD``).
SECRET_SUFFIXES = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "APIKEY", "CREDENTIAL", "CREDENTIALS")

_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")


def name_words(name: str) -> List[str]:
    """The words of a name, upper-cased: ``hfAccess_TOKEN-2`` -> ``["HF", "ACCESS", "TOKEN", "2"]``."""
    return [w.upper() for part in re.split(r"[^A-Za-z0-9]+", name) for w in _WORD.findall(part)]


def is_secret_name(name: str) -> bool:
    """True when a variable, key or query parameter named ``name`` holds a secret (see the module's rule).

    ``HF_TOKEN``, ``GITHUB_PAT``, ``aws_secret_access_key``, ``X-Amz-Signature``, ``hfToken`` are secret;
    ``PATH``, ``KEYBOARD``, ``TOKENIZER``, ``row_tokens`` are not.
    """
    for word in name_words(name):
        if word in SECRET_WORDS or (len(word) > 6 and word.endswith(SECRET_SUFFIXES)):
            return True
    return False


# scheme://user:password@ (the password up to the last @ of the word, so it may hold / and @), or scheme://token@
_URL_USERINFO = re.compile(
    r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<info>[^\s/@:'\"<>]*:[^\s'\"<>]*@|[^\s/@:'\"<>]+@)")
_QUERY = re.compile(r"(?P<head>[?&;](?P<name>[A-Za-z0-9_.~-]+)=)(?P<value>[^&#\s'\"<>]*)")
# NAME=VALUE (shell, Hydra overrides: ``+env.HF_TOKEN=...``), NAME: VALUE (YAML), "NAME": "VALUE" (JSON)
_ASSIGN = re.compile(r"(?<![A-Za-z0-9_])(?P<head>(?:[A-Za-z_][A-Za-z0-9_]*\.)*(?P<name>[A-Z][A-Z0-9_]*)=)"
                     r"(?P<value>'[^'\n]*'|\"[^\"\n]*\"|[^\s,'\"]+)")
_YAML = re.compile(r"(?m)^(?P<head>[ \t-]*(?P<name>[A-Z][A-Z0-9_]*):[ \t]+)(?P<value>\S.*?)[ \t]*$")
_JSON = re.compile(r"(?P<head>\"(?P<name>[A-Z][A-Z0-9_]*)\":\s*)(?P<value>\"(?:[^\"\\\n]|\\.)*\")")

# values shorter than this are only redacted where a pattern finds them, never replaced everywhere
MIN_LEARNED = 8


def _reference(value: str) -> bool:
    """A value that only refers to a variable (``$HF_TOKEN``, ``"${HF_TOKEN:?...}"``): not itself a secret."""
    return value.strip("'\"").startswith("$") or value.strip("'\"") == REDACTED


class Redactor:
    """Replaces secrets in text with ``<redacted>``: values it was taught (:meth:`learn_env`, :meth:`learn_overrides`,
    and every value a pattern found before), then the patterns of the module's rule. Linear in the text's length."""

    def __init__(self) -> None:
        self.known: Set[str] = set()
        self.frozen = False

    def freeze(self) -> "Redactor":
        """Stop learning: later :meth:`scrub` calls redact what the patterns find in place but add no value to
        :attr:`known` (the run's secrets come from its overrides and environment, never from files)."""
        self.frozen = True
        return self

    def _keep(self, value: str) -> None:
        value = value.strip("'\"")
        if not self.frozen and len(value) >= MIN_LEARNED and not _reference(value):
            self.known.add(value)

    def learn_env(self, env: Mapping[str, object]) -> "Redactor":
        """Learn the values of secret-named variables of an environment (the run's ``env`` block)."""
        for name, value in env.items():
            if value is not None and is_secret_name(str(name)):
                self._keep(str(value))
        return self

    def learn_overrides(self, overrides: Iterable[str]) -> "Redactor":
        """Learn the secret values of Hydra overrides (``+env.HF_TOKEN=...``, URLs with credentials)."""
        for word in overrides:
            if sets_secret(word):
                self._keep(word.partition("=")[2])
            self.scrub(word)
        return self

    def scrub(self, text: str) -> str:
        """``text`` with every secret replaced by ``<redacted>``; values the patterns find are learnt."""
        for value in sorted(self.known, key=len, reverse=True):
            if value in text:
                text = text.replace(value, REDACTED)

        def userinfo(m: "re.Match[str]") -> str:
            info = m.group("info")[:-1]
            user, colon, password = info.partition(":")
            self._keep(password if colon else user)
            return f"{m.group('scheme')}{REDACTED}@"

        def named(m: "re.Match[str]") -> str:
            value = m.group("value")
            if not is_secret_name(m.group("name")) or _reference(value) or not value:
                return m.group(0)
            self._keep(value)
            quote = value[0] if value[0] in "'\"" and value[-1] == value[0] and len(value) > 1 else ""
            return f"{m.group('head')}{quote}{REDACTED}{quote}"

        text = _URL_USERINFO.sub(userinfo, text)
        for pattern in (_QUERY, _ASSIGN, _YAML, _JSON):
            text = pattern.sub(named, text)
        return text

    def scrub_bytes(self, data: bytes) -> bytes:
        """:meth:`scrub` on bytes; binary data (a NUL byte) is returned unchanged, other bytes round-trip."""
        if b"\0" in data:
            return data
        return self.scrub(data.decode("utf-8", "surrogateescape")).encode("utf-8", "surrogateescape")


def redact_value(value: str) -> str:
    """``value`` with URL credentials, secret query values and secret ``NAME=VALUE`` parts replaced."""
    return Redactor().scrub(value)


def redact_env(env: Mapping[str, str]) -> Dict[str, str]:
    """A copy of ``env`` sorted by name: secret-named variables become ``<redacted>``, other values lose
    credentials inside URLs (:func:`redact_value`)."""
    return {name: (REDACTED if is_secret_name(name) else redact_value(value)) for name, value in sorted(env.items())}


def sets_secret(word: str) -> bool:
    """Whether the ``NAME=VALUE`` word (a Hydra override, ``+env.HF_TOKEN=...``) sets a secret-named key: the last
    dotted part of NAME, less Hydra's ``+``/``~`` prefixes, by :func:`is_secret_name`."""
    key, sep, _ = word.partition("=")
    return bool(sep) and is_secret_name(key.lstrip("+~").rsplit(".", 1)[-1])


def redact_argv(argv: Iterable[str]) -> List[str]:
    """A command line with the values of secret-named ``NAME=VALUE`` words (``+env.HF_TOKEN=...``) and URL
    credentials redacted."""
    out = []
    for word in argv:
        out.append(f"{word.partition('=')[0]}={REDACTED}" if sets_secret(word) else redact_value(word))
    return out


_GUARDED: Dict[Path, Redactor] = {}


def guard(directory: Path, redactor: Redactor) -> None:
    """From now on, every :func:`trainer.publish.atomic_write` under ``directory`` is scrubbed by ``redactor``."""
    _GUARDED[Path(directory).absolute()] = redactor


def redactor_for(path: Path) -> Optional[Redactor]:
    """The redactor guarding ``path``'s directory (or one above it), or None."""
    path = Path(path).absolute()
    for directory, redactor in _GUARDED.items():
        if path == directory or directory in path.parents:
            return redactor
    return None


SWEEP_MAX_BYTES = 256 << 20


def sweep(directory: Path, redactor: Redactor, verbatim: Iterable[str] = ()) -> List[str]:
    """Pass every regular file under ``directory`` (not following links) through ``redactor``, except those under
    the folders ``verbatim`` names (paths relative to ``directory``: copies of content verified by digest, which a
    rewrite would make untrue); rewrite the files that changed (atomically, keeping their mode: :func:`scrub_file`).
    Returns their paths relative to ``directory``, sorted."""
    directory = Path(directory)
    skipped = [directory / name for name in verbatim]
    changed = []
    for path in sorted(directory.rglob("*")):
        if any(path == top or top in path.parents for top in skipped):
            continue
        if scrub_file(path, redactor):
            changed.append(path.relative_to(directory).as_posix())
    return changed


def scrub_file(path: Path, redactor: Redactor) -> bool:
    """Pass the regular file ``path`` (not a link; at most :data:`SWEEP_MAX_BYTES`) through ``redactor``, rewriting
    it atomically with its mode when that changed it; returns whether it did. A missing file is left alone."""
    from trainer.publish import atomic_write

    path = Path(path)
    if path.is_symlink() or not path.is_file() or path.stat().st_size > SWEEP_MAX_BYTES:
        return False
    data = path.read_bytes()
    clean = redactor.scrub_bytes(data)
    if clean != data:
        atomic_write(path, clean, mode=path.stat().st_mode & 0o777, umask=False)
    return clean != data


def resweep(directory: Path, verbatim: Iterable[str] = ()) -> List[str]:
    """Pass the files others wrote into the guarded ``directory`` (Hydra's, the workers') through its redactor now
    (:func:`sweep`, ``verbatim`` folders aside), so that hashes taken next are those of the files as they stay;
    nothing happens outside a guarded directory. Returns the paths it rewrote."""
    redactor = redactor_for(directory)
    return sweep(directory, redactor, verbatim) if redactor is not None else []
