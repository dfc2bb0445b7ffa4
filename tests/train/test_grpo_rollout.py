"""One GRPO step's rollouts on two data-parallel ranks (rayspeed.train.grpo_rollout.sample_step over a gloo world):
each rank samples its own prompts' groups, the rewards of both ranks' completions make the advantages (equal to
rayspeed.objectives.grpo's over the whole step's rewards in one process, with batch scaling too, whose standard
deviation spans the ranks), both ranks report the same TRL-named metrics, the rows hold the prompt and the
completion with the completion's labels masked in, a truncated completion trains nothing under
mask_truncated_completions, and what a reward function logs reaches the samples."""

from __future__ import annotations

import pytest
import torch

MODEL = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=64, vocab_size=64, seq_len=32)
PROMPTS = [[3, 9, 12], [40, 41], [7, 7, 7, 8], [20]]  # two per rank
END = 5


def longer_is_better(prompts, completions, completion_ids, parity, log_extra, **_):
    log_extra("parity", list(parity))
    return [float(len(ids)) + (0.5 if p == "even" else 0.0) for p, ids in zip(parity, completion_ids)]


def _model():
    from rayspeed.config import parse
    from rayspeed.config.shape import ModelShape
    from rayspeed.model.transformer import Transformer

    return Transformer(ModelShape.from_config(parse({"model": MODEL, "data": {"tokenizer": "tok"}}).model), seed=3)


def _rank(rank, world, scale, mask_truncated):
    import torch.distributed as dist

    from rayspeed.model.generate import Sampling
    from rayspeed.objectives.grpo import GrpoSettings
    from rayspeed.train.grpo_rollout import PromptRecord, RolloutContext, sample_step

    records = [PromptRecord(f"p{i}", ids, {"parity": "even" if i % 2 == 0 else "odd"})
               for i, ids in enumerate(PROMPTS) if i // 2 == rank]
    ctx = RolloutContext(GrpoSettings(num_generations=4, scale_rewards=scale, max_completion_length=6),
                         Sampling(6, temperature=1.5), [longer_is_better], torch.tensor([1.0]),
                         decode=lambda ids: " ".join(map(str, ids)), eos_ids=[END], pad_id=0,
                         group=dist.group.WORLD, generator=torch.Generator().manual_seed(10 + rank),
                         mask_truncated=mask_truncated)
    out = sample_step(_model(), records, ctx)
    return out.ids, out.mask, out.advantages, out.metrics, out.samples


@pytest.mark.parametrize("scale,mask_truncated", [("group", False), ("batch", True)])
def test_two_ranks_sample_score_and_share_the_advantages(scale, mask_truncated):
    from _dist import run_distributed
    from rayspeed.objectives.grpo import GrpoSettings, advantages

    ranks = run_distributed(_rank, 2, scale, mask_truncated, timeout_s=120)
    rewards = torch.tensor([s["reward"] for *_, samples in ranks for s in samples])
    want, _ = advantages(rewards, GrpoSettings(num_generations=4, scale_rewards=scale))
    got = torch.cat([adv for _, _, adv, _, _ in ranks])
    torch.testing.assert_close(got, want)
    assert got.abs().sum() > 0
    assert ranks[0][3] == ranks[1][3]  # every metric is the whole step's
    metrics = ranks[0][3]
    assert set(metrics) == {"reward", "reward_std", "rewards/longer_is_better/mean", "rewards/longer_is_better/std",
                            "frac_reward_zero_std", "completions/mean_length", "completions/clipped_ratio",
                            "rollout/tokens_per_s", "entropy"}
    assert 0 < metrics["entropy"] <= float(torch.log(torch.tensor(float(MODEL["vocab_size"]))))  # nats over 64 ids
    assert metrics["reward"] == pytest.approx(float(rewards.mean()), rel=1e-6)
    lengths = []
    for rank, (ids, mask, _, _, samples) in enumerate(ranks):
        for row, (i, m, sample) in enumerate(zip(ids.tolist(), mask.tolist(), samples)):
            prompt = PROMPTS[rank * 2 + row // 4]
            completion = [int(t) for t in sample["completion"].split()]
            lengths.append(len(completion))
            assert i[:len(prompt) + len(completion)] == prompt + completion
            assert sample["parity"] == ("even" if (rank * 2 + row // 4) % 2 == 0 else "odd")
            truncated = completion[-1] != END
            counted = [j for j, v in enumerate(m) if v]
            if mask_truncated and truncated:
                assert counted == []
            else:
                assert counted == list(range(len(prompt) - 1, len(prompt) - 1 + len(completion)))
    assert metrics["completions/mean_length"] == pytest.approx(sum(lengths) / len(lengths))
    assert 0 < metrics["completions/clipped_ratio"] < 1  # some rows end at END, some run to the limit
