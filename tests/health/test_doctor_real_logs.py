"""`rayspeed doctor` on logs written in the formats real failures print (tests/fixtures/logs): the cause first.

The fixtures copy the wording of the libraries that print them (PyTorch's ProcessGroupNCCL and desync report,
NCCL's net_ib/socket/shmutils warnings, Ray's actor/worker/node death and OOM-killer messages, DeepSpeed's
checkpoint loading, transformers' Trainer log dicts, py-spy dumps, the kernel's OOM killer), with the noise that
surrounds them in a job's log. Each knowledge entry's `source` says where its wording comes from.
"""

import re
from pathlib import Path

import pytest

from rayspeed.cli import main as _cli
from rayspeed.health import doctor, log_detectors, ranking
from rayspeed.health.knowledge import CATEGORIES, load


def _doctor_cli(argv):
    return _cli(["doctor", *argv])


LOGS = Path(__file__).resolve().parents[1] / "fixtures" / "logs"

# fixture -> the category that must come first
EXPECTED = {
    "checkpoint_corrupt.log": "checkpoint_corrupt",
    "checkpoint_latest_missing.log": "checkpoint_missing",
    "checkpoint_missing_model.log": "checkpoint_missing",
    "checkpoint_missing_zero.log": "checkpoint_missing",
    "cuda_oom_then_timeout.log": "oom",
    "env_invalid.log": "env_invalid",
    "grad_blowup_first.log": "grad_explosion",
    "grad_explosion.log": "grad_explosion",
    "grad_overflow_megatron.log": "grad_explosion",
    "hang.log": "hang",
    "hf_trainer_grad_nan.log": "grad_explosion",
    "hf_trainer_nan.log": "nan_loss",
    "hf_trainer_nan_str.log": "nan_loss",
    "linux_oom_then_timeout.log": "oom",
    "nan_loss.log": "nan_loss",
    "nccl_info_then_timeout.log": "nccl_timeout",
    "nccl_timeout.log": "nccl_timeout",
    "nccl_timeout_blocking_env.log": "nccl_timeout",
    "nccl_timeout_desync.log": "nccl_timeout",
    "nccl_timeout_dump_signal.log": "nccl_timeout",
    "network_ib_nccl_info.log": "network",
    "network_ib_ray.log": "network",
    "network_socket_connect.log": "network",
    "network_socket_fallback.log": "network",
    "oom.log": "oom",
    "oom_fragmentation.log": "oom",
    "pyspy_barrier_native.log": "hang",
    "pyspy_hang.log": "hang",
    "ray_actor_died_then_ib_errors.log": "worker_died",
    "ray_actor_died_then_timeout.log": "worker_died",
    "ray_node_died.log": "worker_died",
    "ray_oom_killer.log": "oom",
    "ray_oom_killer_new.log": "oom",
    "ray_worker_segfault.log": "worker_died",
    "shm_dataloader.log": "shm_exhausted",
    "shm_nccl_extend.log": "shm_exhausted",
    "shm_nccl_fallocate.log": "shm_exhausted",
    "slow_throughput.log": "slow_throughput",
}
HEALTHY = ("healthy.log", "healthy_nccl.log", "healthy_hf.log")


def _diagnose(name):
    return doctor.diagnose((LOGS / name).read_text(), log_dir=LOGS)


def _ids(found):
    return [(f.category, f.id) for f in found]


def test_every_fixture_is_scored():
    assert {p.name for p in LOGS.glob("*.log")} == set(EXPECTED) | set(HEALTHY)


def test_the_right_cause_comes_first_for_nine_in_ten():
    misses = []
    for name, category in sorted(EXPECTED.items()):
        found = _diagnose(name)
        if not found or found[0].category != category:
            misses.append(f"{name}: expected {category} first, got {_ids(found)}")
    right = len(EXPECTED) - len(misses)
    assert right / len(EXPECTED) >= 0.9, f"right cause first for {right}/{len(EXPECTED)}:\n" + "\n".join(misses)


@pytest.mark.parametrize("log", HEALTHY)
def test_healthy_logs_report_nothing(log):
    assert _diagnose(log) == []


def test_a_death_ranks_above_the_timeouts_it_caused():
    found = _diagnose("ray_actor_died_then_timeout.log")
    assert [f.category for f in found] == ["worker_died", "nccl_timeout"], _ids(found)
    assert found[1].extra["follows"] == "worker_died (line 3)"


def test_the_survivors_ib_errors_after_a_death_do_not_explain_it():
    # the dead peer's queue pairs vanish: the others' completions fail with status 12 seconds after the death
    found = _diagnose("ray_actor_died_then_ib_errors.log")
    assert [f.id for f in found] == ["worker_died", "nccl_ib_error", "nccl_remote_error"], _ids(found)
    # the same IB error before the death is its cause: the watchdog took the process down after it
    found = _diagnose("network_ib_ray.log")
    assert [f.id for f in found] == ["nccl_ib_error", "nccl_remote_error"] and found[0].extra["led_to"], _ids(found)


def test_an_ib_error_in_nccl_info_lines_outranks_the_hint_about_those_lines():
    found = _diagnose("network_ib_nccl_info.log")
    assert found[0].id == "nccl_ib_error" and "NCCL_IB_HCA" in found[0].remedy, _ids(found)
    assert found[-1].category == "env_invalid" and found[-1].extra["variable"] == "NCCL_DEBUG", _ids(found)
    assert [ranking.tier(f) for f in found] == sorted(ranking.tier(f) for f in found)


@pytest.mark.parametrize("log", ["cuda_oom_then_timeout.log", "linux_oom_then_timeout.log", "ray_oom_killer_new.log"])
def test_an_oom_outranks_the_timeouts_after_it_and_absorbs_the_death(log):
    found = _diagnose(log)
    assert [f.category for f in found] == ["oom", "nccl_timeout"], _ids(found)
    assert found[0].extra["led_to"], "the worker's death should be folded into the OOM that caused it"
    assert found[1].extra["follows"].startswith("oom ")


def test_a_death_whose_own_message_names_the_oom_is_not_a_second_cause():
    # Ray prints the exception header ("The actor died unexpectedly") before the detail (the memory monitor)
    (f,) = _diagnose("ray_oom_killer.log")
    assert f.id == "host_oom" and any("Worker 5 has failed" in e for e in f.extra["led_to"])


def test_actors_on_a_dead_node_died_with_it():
    (f,) = _diagnose("ray_node_died.log")
    assert f.id == "node_died" and f.extra["led_to"]


def test_the_desync_report_names_the_lagging_rank():
    (f,) = _diagnose("nccl_timeout_desync.log")  # the watchdog took its own process down: not a second cause
    assert f.extra["lagging_ranks"] == [5] and "rank(s) 5" in f.cause and f.extra["led_to"]


def test_prose_in_library_messages_is_not_a_finding():
    # "GIL deadlock or ... network errors" (PyTorch's dump signal), "killed by SIGKILL by OOM killer" (Ray's list of
    # possible causes), TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC among ProcessGroupNCCL's logged settings
    assert {f.category for f in _diagnose("nccl_timeout_dump_signal.log")} == {"nccl_timeout"}
    found = _diagnose("nccl_timeout_blocking_env.log")
    assert [(f.category, f.extra.get("variable")) for f in found] == [
        ("nccl_timeout", None), ("env_invalid", "TORCH_NCCL_BLOCKING_WAIT")], _ids(found)


def test_nccl_info_lines_come_last_and_only_beside_a_failure():
    found = _diagnose("nccl_info_then_timeout.log")
    assert _ids(found) == [("nccl_timeout", "nccl_watchdog_timeout"),
                           ("env_invalid", "nccl_debug_info_in_production")]
    assert log_detectors.nccl_info_lines((LOGS / "healthy_nccl.log").read_text().splitlines())


def test_shared_memory_outranks_the_system_error_it_causes():
    found = _diagnose("shm_nccl_fallocate.log")
    assert [f.id for f in found][:2] == ["shm_exhausted", "nccl_system_error"], _ids(found)
    assert "--shm-size" in found[0].remedy and "NCCL_SHM_DISABLE" in found[0].remedy


def test_trainer_dict_lines_are_read():
    old = ["{'loss': 1.41, 'grad_norm': 1.0, 'epoch': 0.1}"] * 3 + ["{'loss': 1.4, 'grad_norm': 30.5, 'epoch': 0.2}"]
    new = [l.replace(": 1.0,", ": '1.0',").replace(": 30.5,", ": '30.5',") for l in old]
    assert [i for i, _, _ in doctor.grad_norm_spikes(old)] == [3]
    assert [i for i, _, _ in doctor.grad_norm_spikes(new)] == [3]
    assert doctor.diagnose("{'loss': 'nan', 'grad_norm': '2.1', 'epoch': '0.3'}")[0].category == "nan_loss"
    assert doctor.diagnose("{'eval_loss': nan, 'epoch': 1.0}")[0].category == "nan_loss"
    assert doctor.diagnose("step 3 loss scale: inf reduced to 32768") == []


def test_a_blow_up_needs_no_baseline():
    blow = log_detectors.grad_norm_blowup
    assert blow(["{'grad_norm': '1.311e+06'}"])["hits"] == [(0, 1.311e6)]
    assert blow(["grad norm: 340282346638528859811704183484516925440.000"])
    assert blow([f"grad_norm: {v}" for v in ("nan", "nan", "1.0")])  # stayed non-finite
    # one Inf is fp16 loss scaling probing its scale (the step is skipped); healthy early norms are in the tens
    assert blow([f"grad_norm: {v}" for v in ("inf", "38.6", "12.1", "4.4")]) is None


def test_pyspy_names_the_process_that_is_not_in_the_collective():
    s = log_detectors.stuck_collectives((LOGS / "pyspy_hang.log").read_text().splitlines())
    assert [p["pid"] for p in s["stuck"]] == ["88121", "88122", "88123"] and s["ops"] == {"all_reduce": 3}
    assert [p["pid"] for p in s["others"]] == ["88124"]
    (f,) = _diagnose("pyspy_hang.log")
    assert "pid 88124 in _read_chunk (rayspeed/data/batches.py:88)" in f.cause
    # a stack that only passes through a collective's file lower down is not waiting in it
    assert log_detectors.stuck_collectives(['Thread 7 (active): "MainThread"', "    step (train.py:10)",
                                            "    barrier (torch/distributed/distributed_c10d.py:4166)"]) is None


def test_help_lists_every_category_with_its_meaning(capsys):
    # a category without a meaning or a tier would be missing from --help (and ranked as a consequence)
    assert set(doctor.CATEGORY_MEANINGS) == set(CATEGORIES) == set(ranking.CATEGORY_TIERS)
    assert _doctor_cli(["--help"]) == 0
    out = capsys.readouterr().out
    for c in CATEGORIES:
        assert re.search(rf"^\s+{c}\s+{re.escape(doctor.CATEGORY_MEANINGS[c][:30])}", out, re.M), c


def test_remedies_name_real_variables_only():
    # A remedy may say that an invented variable does not exist ("there is no NCCL_TIMEOUT"), never advise one.
    kb = load()
    for e in kb.entries:
        for m in re.finditer(r"\b(?:NCCL|TORCH_NCCL)_[A-Z0-9_]+", e.remedy):
            var = m.group(0)
            denied = re.search(r"\bno (?:[A-Z0-9_]+ or )?$", e.remedy[:m.start()])
            status = kb.env.get(var, {}).get("status")
            assert status is not None or denied, f"{e.id}: {var} is not a variable the lint knows"
            assert status != "invented" or denied, f"{e.id}: advises the invented {var}"


def test_new_categories_have_entries_with_sources():
    kb = load()
    for c in ("network", "worker_died", "shm_exhausted", "checkpoint_missing"):
        entries = [e for e in kb.entries if e.category == c]
        assert entries and all(e.cause and e.remedy and e.source for e in entries), c


@pytest.mark.parametrize("log,code", [("shm_nccl_extend.log", 1), ("checkpoint_latest_missing.log", 0),
                                      ("healthy_nccl.log", 0)])
def test_exit_codes(log, code, capsys):
    assert _doctor_cli([str(LOGS / log), "--json"]) == code
