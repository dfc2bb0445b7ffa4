"""The libraries' lines rayspeed silences: only those listed as benign (rayspeed.logs.BENIGN), never what the doctor
diagnoses from, all of them back with --verbose, the accelerator warning kept on GPU jobs."""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path

import pytest

from rayspeed import logs

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "logs"


@pytest.fixture
def fresh_loggers(monkeypatch):
    for k in ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE"):  # quiet_benign sets them: put back after the test
        monkeypatch.setenv(k, "1")
    names = [b.logger for b in logs.BENIGN if b.logger and "/" not in b.logger]
    saved = {n: list(logging.getLogger(n).filters) for n in names}
    for n in names:  # an earlier command in this process (an in-process launch) may have installed them
        logging.getLogger(n).filters = [f for f in saved[n] if not isinstance(f, logs._Drop)]
    with warnings.catch_warnings():
        yield
    for n, f in saved.items():
        logging.getLogger(n).filters = f
    for h in logging.getLogger().handlers:
        h.filters = [x for x in h.filters if not isinstance(x, logs._Drop)]


def _passes(logger: str, msg: str) -> bool:
    record = logging.LogRecord(logger, logging.WARNING, __file__, 1, msg, None, None)
    lg = logging.getLogger(logger)
    return lg.filter(record) and all(h.filter(record) for h in logging.getLogger().handlers)


def test_benign_lines_go_and_others_stay(fresh_loggers, monkeypatch):
    monkeypatch.delenv(logs.VERBOSE_ENV, raising=False)
    assert logs.quiet_benign(use_gpu=False) == len(logs.BENIGN)
    accel = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
    assert not _passes("DeepSpeed", accel)
    assert _passes("DeepSpeed", "[Rank 0] Out of memory while allocating")  # DeepSpeed's other lines stay
    assert not _passes("mlflow.transformers", "Unable to find license information for this model. Please verify")
    assert _passes("mlflow.transformers", "Failed to save the model: disk full")
    assert not _passes("DeepSpeed", "**** You are using ZeRO with an untested optimizer, proceed with caution *****")
    assert not _passes("matplotlib.font_manager", "generated new fontManager")
    assert not _passes("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward from kernels-community: "
                       "No module named 'kernels'. Please make sure you already `pip install kernels`")
    assert _passes("bitsandbytes.backends.cpu.ops", "CUDA error: out of memory")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        logs.quiet_benign(use_gpu=False)
        warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated. Please use x", FutureWarning)
        warnings.warn("something else is deprecated", FutureWarning)
    assert [str(w.message) for w in seen] == ["something else is deprecated"]


def test_a_gpu_job_keeps_the_accelerator_warning_and_verbose_keeps_everything(fresh_loggers, monkeypatch):
    monkeypatch.delenv(logs.VERBOSE_ENV, raising=False)
    assert logs.quiet_benign(use_gpu=True) == len(logs.BENIGN) - 1
    assert _passes("DeepSpeed", "Setting accelerator to CPU. If you have GPU or other accelerator")
    for n in {b.logger for b in logs.BENIGN if b.logger and "/" not in b.logger}:
        logging.getLogger(n).filters = []
    monkeypatch.setenv(logs.VERBOSE_ENV, "1")
    assert logs.quiet_benign(use_gpu=False) == 0
    assert _passes("DeepSpeed", "Setting accelerator to CPU. If you have GPU or other accelerator")


def test_no_colour_codes_unless_stderr_is_a_terminal(monkeypatch):
    monkeypatch.delenv("RAY_COLOR_PREFIX", raising=False)
    logs.plain_unless_terminal()  # pytest's stderr is a file
    import os

    assert os.environ["RAY_COLOR_PREFIX"] == "0"


def test_nothing_silenced_is_evidence_the_doctor_uses():
    from rayspeed.health.diagnosis import diagnose

    patterns = [re.compile(b.pattern) for b in logs.BENIGN]
    checked = 0
    for path in sorted(FIXTURES.glob("*.log")):
        for f in diagnose(path.read_text(errors="replace")):
            for line in f.evidence:
                assert not any(p.search(line) for p in patterns), (path.name, line)
                checked += 1
    assert checked > 20
