"""Running test bodies on several user threads."""
import threading
from typing import Callable, List


def run_threads(target: Callable[[int], None], count: int, timeout: float = 50.0) -> None:
    """Runs ``target(i)`` on ``count`` threads at once. Fails if a thread is
    still running after ``timeout`` seconds (a deadlock) and re-raises the
    first error a thread raised (assertions included)."""
    errors: List[BaseException] = []

    def run(i: int) -> None:
        try:
            target(i)
        except BaseException as error:  # noqa: B902 - re-raised on the test's thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,), name=f"user-{i}") for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    alive = [t.name for t in threads if t.is_alive()]
    assert not alive, f"{alive} still running after {timeout}s: deadlocked?"
    if errors:
        raise errors[0]
