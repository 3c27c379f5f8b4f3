"""The journal's retention: ``[journal] keep_days`` and ``keep_operations`` applied by
``Journal.compact`` once the controller serves, then every ``COMPACT_EVERY_S``, and at once
when asked (``ckptctl journal compact``). What goes: ended operations older than
``keep_days`` or beyond the newest ``keep_operations``, with their records, and records of no
operation older than ``keep_days``; what the controller still reads always stays (see
``Journal.compact``). Freed pages are reused by later writes: the file stops growing rather
than shrinking. Neighbours: ``journal`` (the SQL), ``service`` (owns one), ``server`` (the
request), ``config.JournalConfig``.
"""

from __future__ import annotations

import logging
import threading
import time

from ckpt_controller import protocol as p

log = logging.getLogger("ckpt_controller.journal")

#: how often the journal is compacted while the controller runs
COMPACT_EVERY_S = 3600.0


class JournalRetention:
    def __init__(self, config, journal) -> None:
        self.keep = config.journal
        self.journal = journal
        self._lock = threading.Lock()  # one compaction at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def compact(self) -> p.CompactReply:
        """One compaction now; what went, and the bounds it kept to."""
        with self._lock:
            started = time.monotonic()
            gone = self.journal.compact(self.keep.keep_days, self.keep.keep_operations)
        took = time.monotonic() - started
        if gone["operations"] or gone["records"]:
            log.info("journal: forgot %d operations and %d records (keep_days %g, "
                     "keep_operations %d) in %.2fs", gone["operations"], gone["records"],
                     self.keep.keep_days, self.keep.keep_operations, took)
        return p.CompactReply(operations=gone["operations"], records=gone["records"],
                              keep_days=self.keep.keep_days,
                              keep_operations=self.keep.keep_operations, duration_s=took)

    def start(self) -> None:
        """Compact now and every ``COMPACT_EVERY_S`` on a thread of its own."""
        def loop() -> None:
            while True:
                try:
                    self.compact()
                except Exception:  # policy: logged; the journal stays as it was, tried again
                    log.exception("journal: compacting failed")
                if self._stop.wait(COMPACT_EVERY_S):
                    return
        self._thread = threading.Thread(target=loop, name="journal-retention", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
