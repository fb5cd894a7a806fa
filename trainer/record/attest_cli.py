"""``trainer attest RUN_DIR [--sign-key KEY] [--again]``: the (signed) attestation of a run that ended outside
``train``, a Slurm job. The run directory is sealed by :meth:`trainer.record.rundir.RunDir.seal`, which writes the
attestation (:func:`trainer.record.attest.write_run_attestation`); this module is the command on top of both.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from trainer.errors import UserError
from trainer.record.names import ATTESTATION
from trainer.record.record import effective_status
from trainer.record.rundir import FINAL, RunDir
from trainer.signing import load_signer


def main(argv: list[str]) -> int:
    """``trainer attest RUN_DIR [--sign-key KEY] [--again]``: write the attestation of a run that ended outside
    ``train`` (a Slurm job: after ``trainer status --wait``); refuses a run that has not ended, or one that has an
    attestation already unless ``--again`` (a file written after the seal, Slurm's last log lines: the record's
    hashes and the attestation are made anew from the files as they are now)."""
    parser = argparse.ArgumentParser(prog="trainer attest", description=main.__doc__)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--sign-key", type=Path, help="private key (`trainer keygen`): write a signed DSSE envelope")
    parser.add_argument(
        "--again",
        action="store_true",
        help="replace an existing attestation (after a late log: "
        "what the files are now is what the new one vouches for)",
    )
    args = parser.parse_args(argv)
    signer = load_signer(args.sign_key) if args.sign_key else None
    rundir = RunDir(args.run_dir)
    record = rundir.load_record()
    if record is None:
        raise UserError(f"{args.run_dir / 'record.json'}: no run record (is {args.run_dir} a run directory?)")
    status = effective_status(record)
    if status not in FINAL:
        raise UserError(
            f"{args.run_dir}: status {status!r}; a run is attested once it has ended (`trainer status --wait`)"
        )
    if (args.run_dir / ATTESTATION).exists() and not args.again:
        raise UserError(
            f"{args.run_dir / ATTESTATION}: exists (an attestation is written once; --again replaces it "
            "with one of the files as they are now)"
        )
    record = rundir.seal(record, signer)
    if "error" in record["attestation"]:
        raise UserError(f"{args.run_dir}: not attested: {record['attestation']['error']}")
    print(f"{args.run_dir / ATTESTATION}: " + (f"signed by {signer.public_key.keyid}" if signer else "unsigned"))
    return 0
