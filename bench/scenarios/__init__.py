"""The benchmark's scenarios, one module each, in the order a repetition runs them.

A data-path scenario (:class:`~bench.scenarios.base.DataScenario`) is measured in every repetition with every mode;
the control-plane scenarios (:mod:`bench.scenarios.controlplane`) run once, after the repetitions.
"""

from __future__ import annotations

from bench.scenarios.base import DataScenario
from bench.scenarios.connrate import ConnRate
from bench.scenarios.latency import Latency
from bench.scenarios.memory import Memory
from bench.scenarios.throughput import Throughput

DATA: tuple[type[DataScenario], ...] = (Throughput, Latency, ConnRate, Memory)
DATA_SCENARIOS = tuple(s.name for s in DATA)
SCENARIOS = (*DATA_SCENARIOS, "controlplane")
