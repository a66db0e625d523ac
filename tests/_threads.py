"""Run test work on several threads at once (the thread-safety tests: autocast state, host-path workspaces)."""

from __future__ import annotations

import threading
from typing import Any, Callable, List, Sequence


def run_in_threads(fn: Callable[..., Any], args: Sequence[tuple]) -> List[Any]:
    """``fn(*a)`` for each ``a`` in ``args``, each on its own thread, all started before any is joined; the results
    in order. An exception raised in a thread is raised here (pytest would not see it in the thread)."""
    results: List[Any] = [None] * len(args)
    errors: List[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = fn(*args[i])
        except BaseException as exc:  # noqa: BLE001 - re-raised below, on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
