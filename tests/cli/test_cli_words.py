"""How `qm show` words a job's shape, and how a job's command is worded as typed
(the API's `command_as_typed`, which `qm show` prints): one line per case."""

from __future__ import annotations

import argparse
import shlex
from typing import Any

import pytest

from preemption.typed_command import command_as_typed
from qmcli.cli import gpus_words, ranks_argument


@pytest.mark.parametrize(
    ("ranks", "gpus_per_rank", "words"),
    [
        (1, 1, "1 rank × 1 GPU (h100-80gb)"),
        (1, 8, "1 rank × 8 GPUs (h100-80gb)"),
        (2, 1, "2 ranks × 1 GPU = 2 GPUs (h100-80gb)"),
        (2, 4, "2 ranks × 4 GPUs = 8 GPUs (h100-80gb)"),
    ],
)
def test_gpus_words(ranks: int, gpus_per_rank: int, words: str) -> None:
    job = {
        "ranks": ranks,
        "gpus_per_rank": gpus_per_rank,
        "gpus": ranks * gpus_per_rank,
        "flavor": "h100-80gb",
    }
    assert gpus_words(job) == words


@pytest.mark.parametrize(
    ("elastic", "attempts", "words"),
    [
        (
            {"ranks_min": 2, "rank_sizes": []},
            [],
            "8 ranks (elastic 2–8) × 1 GPU = 8 GPUs (h100-80gb)",
        ),
        (
            {"ranks_min": 2, "rank_sizes": []},
            [{"world_size": 8}, {"world_size": 4}],
            "4 ranks (elastic 2–8) × 1 GPU = 4 GPUs (h100-80gb)",
        ),
        (
            {"ranks_min": 2, "rank_sizes": [2, 4, 8]},
            [{"world_size": 2}],
            "2 ranks (elastic 2, 4, 8) × 1 GPU = 2 GPUs (h100-80gb)",
        ),
        (
            {"ranks_min": None, "rank_sizes": []},
            [{"world_size": 8}],
            "8 ranks × 1 GPU = 8 GPUs (h100-80gb)",
        ),
    ],
)
def test_gpus_words_of_an_elastic_job_say_its_size_now_and_its_range(
    elastic: dict[str, Any], attempts: list[dict[str, Any]], words: str
) -> None:
    job = {"ranks": 8, "gpus_per_rank": 1, "gpus": 8, "flavor": "h100-80gb", "attempts": attempts}
    assert gpus_words({**job, **elastic}) == words


@pytest.mark.parametrize(
    ("typed", "sent"),
    [("8", 8), ("2:8", {"min": 2, "max": 8}), ("2,4,8", {"sizes": [2, 4, 8]})],
)
def test_ranks_argument_is_sent_as_the_api_takes_it(typed: str, sent: Any) -> None:
    assert ranks_argument(typed) == sent


@pytest.mark.parametrize("typed", ["two", "2:", "a:8", "2,,8", "2-8"])
def test_a_ranks_argument_of_another_form_is_a_usage_error(typed: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="takes N, MIN:MAX or SIZE,SIZE"):
        ranks_argument(typed)


@pytest.mark.parametrize(
    ("words", "shown"),
    [
        (["python", "train.py", "--steps", "10"], "python train.py --steps 10"),
        (["python", "-c", "print('hi')"], "python -c \"print('hi')\""),
        (["echo", "a b", ""], "echo 'a b' ''"),
        (["echo", "$HOME `date`"], "echo '$HOME `date`'"),
        (["say", 'it\'s "x"'], "say 'it'\"'\"'s \"x\"'"),
        (["echo", "wow!"], "echo 'wow!'"),
    ],
)
def test_a_command_of_words_is_shown_as_typed_and_means_the_same(
    words: list[str], shown: str
) -> None:
    stored = shlex.join(words)  # as `qm submit -- WORDS` stores it
    assert command_as_typed(stored) == shown
    assert shlex.split(shown) == words


@pytest.mark.parametrize(
    "line",
    [
        "cd /work && python train.py | tee log.txt",
        "python train.py --lr $LR",
        "echo 'unclosed",
        "",
    ],
)
def test_a_command_written_as_one_line_is_shown_as_written(line: str) -> None:
    assert command_as_typed(line) == line
