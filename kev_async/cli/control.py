"""`kev control resign` and `kev control keygen`: the operator's side of kafka.trust key rotation
(consumers/control/history.py; the procedure is in docs/reliability.md#signed-records)."""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

import anyio

from kev_async.cli._shared import load_service_config
from schemas import EMBEDDED_BROKER
from schemas.kafka_config import ALL_TRUST_SCOPES

RESIGN_HELP = """\
Read kafka.control_topic from its first record, find the command in force under each key (what every
worker applies at its next start), and publish it again signed by kafka.trust.sign_key with a new
sequence number, when another key signed it. Cancels are left alone (history).

Run it during a key rotation, with a config whose kafka.trust holds the old key (to verify what it
signed; for Ed25519 its public key is enough) and the new key as sign_key, with scope control. A
command whose signature this config cannot verify is never signed again (anyone may write a record
naming a removed key): it is listed, and --drop-unverifiable tombstones it instead. A worker refuses to
start while kept commands are signed by keys it does not have; after this, it starts and applies them.

Prints one line per kept command (resigned, current, unverifiable, dropped, not_in_force); exits 0 when
nothing unverifiable is left, 1 otherwise, 2 on a config or broker error."""

KEYGEN_HELP = """\
Print a fresh Ed25519 key pair as kafka.trust.keys entries: the private one for the signer (the gateway,
an operator's tool; keep it in a keys_file or KEV_KAFKA__TRUST__KEYS, not in a shared kev.yaml), the
public one for every worker, which then verifies what the key signs and cannot sign itself."""


def register(subparsers: argparse._SubParsersAction) -> None:
    control = subparsers.add_parser("control", help="sign control commands again after a key rotation; make keys",
                                    description="The operator's side of kafka.trust: key rotation and keys.")
    actions = control.add_subparsers(dest="control_command", metavar="ACTION", required=True)
    resign = actions.add_parser("resign", help="sign the kept control commands again with kafka.trust.sign_key",
                                description=RESIGN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    resign.add_argument("--config", default=None, help="a kev.yaml (default: built-in defaults + KEV_* env)")
    resign.add_argument("--bootstrap-servers", default=None, help="HOST:PORT[,HOST:PORT] of a running broker")
    resign.add_argument("--dry-run", action="store_true", help="say what would be published; publish nothing")
    resign.add_argument("--drop-unverifiable", action="store_true",
                        help="tombstone kept commands signed by keys this config does not have (their keys' "
                             "commands are then gone for good), instead of leaving them for a worker to refuse")
    resign.set_defaults(func=_resign, model=None)
    keygen = actions.add_parser("keygen", help="print a new Ed25519 key pair for kafka.trust.keys",
                                description=KEYGEN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    keygen.add_argument("--id", default="ops-1", help="the key id (1 to 64 characters; default ops-1)")
    keygen.add_argument("--scopes", default="control",
                        help=f"comma-separated, of {','.join(ALL_TRUST_SCOPES)} (default control; a gateway's key: "
                             "questions,cancel)")
    keygen.add_argument("--private-file", metavar="PATH",
                        help="write the signer's entry to PATH (a kafka.trust.keys_file, mode 0600) instead of printing it")
    keygen.add_argument("--public-file", metavar="PATH",
                        help="write the workers' entry to PATH (a kafka.trust.keys_file) instead of printing it")
    keygen.add_argument("--if-missing", action="store_true",
                        help="with both files given: keep them and do nothing when both exist (a container's first start "
                             "makes the pair, later starts keep it)")
    keygen.set_defaults(func=_keygen)


def _resign(args: argparse.Namespace) -> int:
    from aiokafka.errors import KafkaError  # aiokafka and structlog: not imported for `kev --help`

    from consumers.control.history import resign

    cfg = load_service_config(args, bootstrap_servers=args.bootstrap_servers)
    if cfg.kafka.bootstrap_servers == EMBEDDED_BROKER:
        print("kev control resign: needs the running broker the workers use (--bootstrap-servers or "
              "kafka.bootstrap_servers)", file=sys.stderr)
        return 2
    try:
        outcomes = anyio.run(partial(resign, cfg.kafka, dry_run=args.dry_run,
                                     drop_unverifiable=args.drop_unverifiable), backend="asyncio")
    except (KafkaError, OSError, TimeoutError) as error:
        print(f"kev control resign: {error}", file=sys.stderr)
        return 2
    for outcome in outcomes:
        print(f"{outcome.verdict:<13} {outcome.command}: {outcome.detail}")
    left = sum(outcome.verdict == "unverifiable" for outcome in outcomes)
    done = "would be published" if args.dry_run else "published"
    changed = sum(outcome.verdict in ("resigned", "dropped") for outcome in outcomes)
    print(f"{len(outcomes)} kept commands on {cfg.kafka.control_topic}: {changed} {done}, {left} unverifiable")
    return 1 if left else 0


def _keygen(args: argparse.Namespace) -> int:
    from schemas.signing import new_ed25519_pair

    scopes = [scope.strip() for scope in args.scopes.split(",") if scope.strip()]
    unknown = sorted(set(scopes) - set(ALL_TRUST_SCOPES))
    if unknown or not scopes or not 1 <= len(args.id) <= 64:
        print(f"kev control keygen: --scopes takes some of {', '.join(ALL_TRUST_SCOPES)} (got {args.scopes!r}); "
              "--id 1 to 64 characters", file=sys.stderr)
        return 2
    files = (args.private_file, args.public_file)
    if args.if_missing and all(files) and all(os.path.exists(path) for path in files):
        print(f"kev control keygen: {args.private_file} and {args.public_file} exist; kept")
        return 0
    private, public = new_ed25519_pair()
    shown = ", ".join(scopes)
    signer = f"{args.id}: {{private_key: \"{private}\", scopes: [{shown}]}}\n"
    worker = f"{args.id}: {{public_key: \"{public}\", scopes: [{shown}]}}\n"
    if args.private_file:
        _write_keys(args.private_file, signer, private=True)
    else:
        print("# the signer's kafka.trust.keys entry (secret: a keys_file or KEV_KAFKA__TRUST__KEYS)\n" + signer, end="")
    if args.public_file:
        _write_keys(args.public_file, worker, private=False)
    else:
        print("# every worker's entry (verifies, cannot sign)\n" + worker, end="")
    return 0


def _write_keys(path: str, entry: str, *, private: bool) -> None:
    """A keys_file holding one entry; the private one readable by its owner only, from its first byte."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "w") as out:
        out.write(entry)
    whose = "the signer's" if private else "the workers'"
    print(f"kev control keygen: wrote {whose} key to {path}")
