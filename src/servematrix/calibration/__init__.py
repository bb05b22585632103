"""Calibration: time a short designed set of probes against a running deployment (``probes``),
fit a step-time profile's physically named terms to them (``fit``), and run both from the
command line (``cli``, ``servematrix calibrate``). The profile itself, and how the engine uses
it, are ``servematrix.engine.profile``."""
