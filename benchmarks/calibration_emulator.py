"""``servematrix calibrate`` against the emulator, then probes the fit never saw: predicted
against measured.

Starts the emulator (Qwen2.5-7B GPTQ-Int4 modelled on an A100, a real process on a free
loopback port), runs ``servematrix calibrate`` on it (its 14 designed probes), then measures
two held-out probes (a 768-token prompt alone, a batch of 8 at 512 tokens: a length and a batch
the probe set does not use) ``--repeats`` times and prints, per quantity, the median measured
time, the profile's prediction and their ratio, then the fit's terms and residuals. The
emulator's step times are simulated physics paced by the wall clock, so this machine's load
adds to what the client measures: the ratios are this run's, not a bound.

Usage (from the repository root; about a minute)::

    .venv/bin/python benchmarks/calibration_emulator.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
from real_vllm_chat import free_port

from servematrix.calibration.probes import Probe
from servematrix.calibration.run import Settings, probe_server
from servematrix.engine.architecture import load_architecture
from servematrix.engine.profile import TERMS, read_profile

SERVED = "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4"
BIN = Path(sys.executable).parent
HELD_OUT = [Probe("prefill", 768, 1, 8), Probe("decode", 512, 8, 32)]
"""A prompt length and a batch the probe set does not use."""


def wait_listening(port: int, process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the emulator exited with {process.returncode} before it listened")
        try:
            with socket.create_connection(("127.0.0.1", port), 0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"the emulator did not listen on port {port} within {timeout_s:.0f} s")


def held_out_medians(url: str, repeats: int) -> dict[tuple[str, str], tuple[float, tuple]]:
    """Median seconds of each held-out probe's quantity over ``repeats`` runs, with its
    features (the model's row)."""
    settings = Settings(url, SERVED, load_architecture("qwen2.5-7b").vocab_size, repeats, 99)
    _, rows, _ = asyncio.run(probe_server(settings, HELD_OUT, print))
    groups = defaultdict(list)
    for row in rows:
        groups[(row.probe, row.quantity)].append(row)
    return {
        key: (statistics.median(r.seconds for r in group), group[0].features())
        for key, group in groups.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    out = Path(tempfile.mkdtemp(prefix="calibration-emulator-")) / "profile.yaml"
    argv = [str(BIN / "servematrix-emulator"), "serve", SERVED, "--host", "127.0.0.1"]
    server = subprocess.Popen([*argv, "--port", str(port), "--max-model-len", "4096"])
    try:
        wait_listening(port, server)
        calibrate = [str(BIN / "servematrix"), "calibrate", "--url", url, "--model", SERVED]
        calibrate += ["--architecture", "qwen2.5-7b", "--quantization", "gptq-int4"]
        subprocess.run([*calibrate, "--server", "servematrix-emulator", "--out", str(out)],
                       check=True)  # fmt: skip
        measured = held_out_medians(url, args.repeats)
    finally:
        server.terminate()
        server.wait(timeout=30)
    profile = read_profile(out)
    terms = np.array(profile.terms.vector())
    print(f"\nprofile {out}: {profile.residuals.observations} observations, median |residual| "
          f"{profile.residuals.median_abs_relative:.1%}")  # fmt: skip
    for name, value, error in zip(TERMS, profile.terms.vector(), profile.stderr.vector(),
                                  strict=True):  # fmt: skip
        print(f"  {name:<22} {value:.4g} ± {error:.2g}")
    print(f"\n{'held-out probe':<16} {'quantity':<20} {'measured ms':>11} {'predicted ms':>12} "
          f"{'ratio':>6}")  # fmt: skip
    for (probe, quantity), (seconds, features) in sorted(measured.items()):
        predicted = float(np.dot(features, terms))
        print(f"{probe:<16} {quantity:<20} {seconds * 1e3:>11.2f} {predicted * 1e3:>12.2f} "
              f"{predicted / seconds:>6.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
