"""Glue between Snakemake and the package: the one config check, clean errors, job logging."""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from servematrix import backends, preflight
from servematrix.common.terminal import for_terminal
from servematrix.spec import config
from servematrix.spec.matrix import PREDICTING_BACKEND, Config, ConfigError

DEFAULT_CONFIGFILE = "config/config.yaml"


def check_config(raw: Mapping[str, Any], schema_path: Path = config.SCHEMA_PATH) -> Config:
    """Everything that must hold before any job: `servematrix check` and the workflow run this."""
    cfg = config.load(raw, schema_path)
    backends.check(cfg.backend)
    _check_confirm_top(cfg)
    backends.backend_of(cfg.backend).preflight(cfg)
    preflight.check(cfg)
    return cfg


def _check_confirm_top(cfg: Config) -> None:
    """``confirm_top`` deploys the simulator's top topologies on a measured backend; the
    simulator itself searches them all already."""
    if backends.backend_of(cfg.backend).MEASURED:
        return
    for name, study in cfg.studies.items():
        if study.confirm_top is not None:
            raise ConfigError(
                f"studies.{name}.confirm_top",
                f"confirms on a measured backend ({', '.join(backends.names(MEASURED=True))}); "
                f"backend {cfg.backend} searches every topology already",
            )


def merged(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """``update`` merged into ``base`` key by key, nested mappings too (as Snakemake merges)."""
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            merged(base[key], value)
        else:
            base[key] = value
    return base


def parse_overrides(entries: Sequence[str]) -> dict[str, Any]:
    """``--config KEY=VALUE ...`` parsed exactly as Snakemake parses its own."""
    from snakemake.cli import parse_config

    try:
        return parse_config(entries)
    except ValueError as error:
        raise ConfigError("--config", str(error)) from None


def workflow_config(
    configfiles: Sequence[str | Path],
    overrides: Mapping[str, Any],
    schema_path: Path = config.SCHEMA_PATH,
) -> Config:
    """The config a Snakemake run plans: ``--config configfile=FILE`` or the ``--configfile``
    files if given, else ``config/config.yaml`` (never merged with it), read with servematrix's
    own YAML loader (a repeated key, a syntax error's line), then the other ``--config
    KEY=VALUE`` overrides. Snakemake parses a ``--configfile`` itself first, and reports a
    syntax error there without its line; ``--config configfile=FILE`` leaves that to us."""
    overrides = dict(overrides)
    if "configfile" in overrides:
        configfiles = [str(overrides.pop("configfile"))]
    raw: dict[str, Any] = {}
    for path in configfiles or [DEFAULT_CONFIGFILE]:
        path = Path(path)
        if path.is_absolute() and path.is_relative_to(Path.cwd()):
            path = path.relative_to(Path.cwd())  # named as the user typed it, as `check` does
        merged(raw, config.read_yaml(path))
    return check_config(merged(raw, overrides), schema_path)


def predicted_config(cfg: Config) -> Config | None:
    """The simulator's twin of a measured run (the same studies and cells, backend simulator),
    for the report's predicted-vs-measured comparison; None on the simulator itself.

    Raises ConfigError when the engine cannot model the config (a model that does not fit the
    modelled GPU, which the vllm and external backends never check)."""
    if not backends.backend_of(cfg.backend).MEASURED:
        return None
    studies = {  # the twin searches every topology: it is where the measured run picks from
        name: {key: value for key, value in study.items() if key != "confirm_top"}
        for name, study in cfg.raw["studies"].items()
    }
    return check_config({**cfg.raw, "backend": PREDICTING_BACKEND, "studies": studies})


def stop_deployments(cfg: Config) -> None:
    """Stop every warm deployment of the run, on a backend that deploys (onsuccess, onerror,
    and at the exit of a cluster job)."""
    backend = backends.backend_of(cfg.backend)
    if backend.DEPLOYS:
        from servematrix.deploy import order

        order.stop_deployments(cfg, machine_wide=backend.REAL_HARDWARE)


def requested_report(argv: Sequence[str]) -> str | None:
    """The FILE of ``snakemake --report [FILE]`` without a run first (``--report-after-run``
    runs first), else None; FILE as Snakemake's argparse reads it (default report.html)."""
    if "--report-after-run" in argv:
        return None
    for i, arg in enumerate(argv):
        if arg.startswith("--report="):
            return arg.partition("=")[2]
        if arg == "--report":
            following = argv[i + 1] if i + 1 < len(argv) else "-"
            return "report.html" if following.startswith("-") else following
    return None


def stop_report_on_interrupt(path: str) -> None:
    """Ctrl-C while Snakemake plans or writes a report: one line and exit status 130, not the
    KeyboardInterrupt traceback (Snakemake catches only Exception around a report), and no
    half-written report (a zip report is written file by file). A report that was there
    before and is not yet being overwritten is left as it was.

    The process ends at once (``os._exit``): an exception raised wherever Snakemake is (an
    asyncio loop half built) would print the tracebacks of half-built objects as it unwinds,
    and a report holds no lock and writes nothing else to clean up."""
    before = _stat(path)

    def on_sigint(signum: int, frame: Any) -> None:
        if _stat(path) != before:
            with contextlib.suppress(OSError):
                os.remove(path)
        print(f"servematrix: interrupted; the report {path} was not written", file=sys.stderr)
        sys.stderr.flush()
        os._exit(130)

    signal.signal(signal.SIGINT, on_sigint)


def _stat(path: str) -> tuple[int, int] | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size


def missing_results(paths: Iterable[str]) -> str | None:
    """One line for a report asked before the results it packs exist, else None."""
    missing = [path for path in paths if not Path(path).exists()]
    if not missing:
        return None
    more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
    return (
        f"servematrix: no results to report yet ({missing[0]}{more} missing): "
        "run `snakemake --cores 1 all` first"
    )


@contextlib.contextmanager
def fail_on_config_error() -> Iterator[None]:
    """Turn a ConfigError into one line on stderr and exit 1, instead of a Snakemake traceback."""
    try:
        yield
    except ConfigError as error:
        print(f"servematrix: {error}", file=sys.stderr)
        sys.stderr.flush()
        sys.exit(1)


class JobFailed(RuntimeError):
    """An in-process job's explained error, without the frames it was raised through."""


def _explained(error: Exception) -> bool:
    """An error servematrix raises to say what is wrong with an input (a trace, a config, a
    server), named in its message: a traceback would add nothing. Anything else is a bug."""
    return type(error).__module__.startswith("servematrix.") and isinstance(
        error, ValueError | RuntimeError
    )


_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_IN_PROCESS = threading.Lock()


@contextlib.contextmanager
def in_process_job(log_path: str) -> Iterator[logging.Logger]:
    """A job that runs inside the Snakemake process: a `run:` rule (a simulated cell or capacity
    search, a summary, a findings page, a study's charts), which the default profile's
    ``force-use-threads`` runs in a thread, where a script job would pay ~1.3 s for a new
    interpreter and its imports.

    One such job at a time (the simulator is single-threaded Python and its step-time caches
    are shared, so a second thread would only wait for the first); the package's log records
    from this thread go to the job's log file, and so does the error that fails the job.
    """
    handlers = [_file_handler(log_path), _terminal_handler()]
    thread = threading.get_ident()
    for handler in handlers:
        handler.addFilter(lambda record: record.thread == thread)
    logger = logging.getLogger("servematrix")
    with _IN_PROCESS:
        level = logger.level
        logger.setLevel(logging.INFO)
        for handler in handlers:
            logger.addHandler(handler)
        try:
            yield logger
        except Exception as error:
            if not _explained(error):
                logger.error("job failed: %s", error, exc_info=True)
                raise
            # One line on the terminal and in the log. Snakemake prints the frames any
            # exception of a `run:` block passed through: a new one, raised here, passes
            # through the job's own (SystemExit would hang Snakemake's job thread).
            logger.error("job failed: %s", error)
            raise JobFailed(str(error)) from None
        finally:
            for handler in handlers:
                logger.removeHandler(handler)
                handler.close()
            logger.setLevel(level)


_WORKERS: list[concurrent.futures.ProcessPoolExecutor] = []
_WORKERS_LOCK = threading.Lock()
PR_SET_PDEATHSIG = 1


def worker_job(log_path: str, job: Callable[..., None], *args: Any) -> None:
    """A CPU-bound simulator job (a deployment's capacity search) in a worker process, so that
    such jobs use every core Snakemake was given instead of taking turns in its process (as
    `in_process_job`s do). The workers fork from a server that imported the package once, so a
    job costs no interpreter start; the job's log records go to its log file, and an error
    fails the job here."""
    future = _worker_pool().submit(_logged_job, log_path, job, *args)
    future.result()


def _worker_pool() -> concurrent.futures.ProcessPoolExecutor:
    with _WORKERS_LOCK:
        if not _WORKERS:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(["servematrix.capacity.run"])
            _WORKERS.append(
                concurrent.futures.ProcessPoolExecutor(
                    max_workers=os.cpu_count() or 1,
                    mp_context=context,
                    initializer=_die_with_parent,
                )
            )
        return _WORKERS[0]


def _die_with_parent() -> None:
    """A worker ends with the Snakemake process that started it (Linux's parent-death signal),
    even when Snakemake itself is killed."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _logged_job(log_path: str, job: Callable[..., None], *args: Any) -> None:
    handler = _file_handler(log_path)
    logger = logging.getLogger("servematrix")
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        job(*args)
    except Exception as error:
        logger.error("job failed: %s", error, exc_info=True)
        raise
    finally:
        logger.removeHandler(handler)
        handler.close()


def _file_handler(path: str) -> logging.Handler:
    handler = logging.FileHandler(path, mode="w")
    handler.setFormatter(logging.Formatter(_LOG_FORMAT))
    return handler


def _terminal_handler() -> logging.Handler:
    """Waits and warnings (`servematrix.common.terminal`) for the person watching, one line each."""
    terminal = logging.StreamHandler(sys.stderr)
    terminal.addFilter(lambda record: for_terminal(record) and not record.exc_info)
    terminal.setFormatter(logging.Formatter("servematrix: %(message)s"))
    return terminal


def log_to(path: str) -> logging.Logger:
    """Send the package's log records (and warnings) to a job's Snakemake log file."""
    root = logging.getLogger()
    root.handlers[:] = [_file_handler(path), _terminal_handler()]
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)
    logger = logging.getLogger("servematrix")
    previous_hook = sys.excepthook

    def log_uncaught(kind, error, tb):
        # The job's own log must say why it failed, not only Snakemake's console.
        logger.error("job failed: %s", error, exc_info=(kind, error, tb))
        previous_hook(kind, error, tb)

    sys.excepthook = log_uncaught
    return logger


def interruption(stop: KeyboardInterrupt) -> str:
    """Why a job stopped: the signal a handler named, else Ctrl-C's SIGINT (Python's own
    KeyboardInterrupt carries no message)."""
    return str(stop) or "signal SIGINT"


def _children(pid: int | str) -> list[int]:
    """A process's direct children (Linux: /proc/PID/task/*/children)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(child) for child in (task / "children").read_text().split()]
    return found


def stop_jobs_on_interrupt() -> None:
    """SIGINT to Snakemake alone (``kill -INT``, an IDE's stop button; Ctrl-C in a terminal
    reaches the jobs too) makes Snakemake wait for the running jobs to finish, then count their
    results as incomplete: a cell would run to its end and be run again. So a SIGINT here first
    sends SIGTERM to each job (the job's shell and the script it runs), which stops a cell as
    Snakemake's own cancelling does (its deployment stopped, no trace written); then Snakemake
    stops as it would."""
    previous = signal.getsignal(signal.SIGINT)

    def on_sigint(signum: int, frame: Any) -> None:
        for shell in _children("self"):
            for pid in (shell, *_children(shell)):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGTERM)
        if callable(previous):
            previous(signum, frame)
        else:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
