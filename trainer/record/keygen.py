"""``trainer keygen --out KEY [--type ed25519|ecdsa]``: an offline key pair for signing (see
:mod:`trainer.record.attest`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from trainer.signing import KEY_TYPES, keygen


def main(argv: list[str]) -> int:
    """Write KEY (PKCS#8 PEM, 0600) and KEY.pub (SubjectPublicKeyInfo PEM); print both paths and the key id.
    Returns 0; an existing KEY or KEY.pub is refused (:class:`~trainer.errors.UserError`, nothing written)."""
    parser = argparse.ArgumentParser(
        prog="trainer keygen",
        description="make an offline signing key pair: KEY (PKCS#8 PEM, 0600) and KEY.pub (SubjectPublicKeyInfo PEM)",
    )
    parser.add_argument("--out", required=True, type=Path, help="private key path; the public key is OUT.pub")
    parser.add_argument(
        "--type",
        default="ed25519",
        choices=KEY_TYPES,
        help="ed25519 (default, deterministic signatures) or ecdsa (P-256, SHA-256)",
    )
    args = parser.parse_args(argv)
    private, public, keyid = keygen(args.out, args.type)
    print(f"private key {private} (keep it secret)\npublic key  {public}\nkey id      {keyid}")
    return 0
