"""A CPU worker leaves one core to the API process, unless the user chose its threads."""

from __future__ import annotations

import torch

from dsv4serve.worker.model_load import cpu_worker_threads, usable_cores, worker_device


def test_every_core_but_one_and_the_users_choice_wins() -> None:
    assert [cpu_worker_threads({}, cores) for cores in (1, 2, 16)] == [1, 1, 15]
    assert cpu_worker_threads({"OMP_NUM_THREADS": "3"}, 16) is None  # torch already follows it
    assert cpu_worker_threads({"OMP_NUM_THREADS": ""}, 4) == 3  # set but empty: not a choice
    assert usable_cores() >= 1


def test_the_cpu_worker_applies_it(monkeypatch) -> None:
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("dsv4serve.worker.model_load.usable_cores", lambda: 3)
    try:
        assert worker_device("cpu") == torch.device("cpu") and torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(before)
        worker_device("cpu")
        assert torch.get_num_threads() == before  # left alone
    finally:
        torch.set_num_threads(before)
