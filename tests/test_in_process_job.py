"""servematrix.workflow.in_process_job: a `run:` rule's job inside the Snakemake process."""

from __future__ import annotations

import logging
import threading

import pytest

from servematrix.workflow import in_process_job

log = logging.getLogger("servematrix.test")


def test_the_jobs_records_and_only_its_threads_reach_its_log(tmp_path):
    path = tmp_path / "job.log"
    other_thread_logged = threading.Event()

    def other_job() -> None:
        log.info("from another thread")
        other_thread_logged.set()

    with in_process_job(str(path)):
        log.info("cell simulated")
        worker = threading.Thread(target=other_job)
        worker.start()
        worker.join()
    log.info("after the job")
    assert other_thread_logged.is_set()
    text = path.read_text()
    assert "INFO servematrix.test: cell simulated" in text
    assert "another thread" not in text and "after the job" not in text
    assert not any(
        isinstance(h, logging.FileHandler) for h in logging.getLogger("servematrix").handlers
    )


def test_a_failing_job_logs_its_error_and_raises_it(tmp_path):
    path = tmp_path / "job.log"
    with pytest.raises(ValueError, match="bad trace"), in_process_job(str(path)):
        raise ValueError("bad trace x.parquet")
    assert "ERROR servematrix: job failed: bad trace x.parquet" in path.read_text()


def test_in_process_jobs_run_one_at_a_time(tmp_path):
    inside, overlapped = threading.Event(), []

    def job(name: str) -> None:
        with in_process_job(str(tmp_path / f"{name}.log")):
            overlapped.append(inside.is_set())
            inside.set()
            threading.Event().wait(0.05)
            inside.clear()

    threads = [threading.Thread(target=job, args=(str(i),)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert overlapped == [False] * 4


def test_waits_and_fallbacks_reach_the_terminal_too(tmp_path, capsys):
    from servematrix.common.terminal import TERMINAL

    with in_process_job(str(tmp_path / "job.log")):
        log.info("roofline model for x", extra=TERMINAL)
        log.info("only in the log")
    assert capsys.readouterr().err == "servematrix: roofline model for x\n"
