"""Weight publication: a policy.dtype payload in two slots, read without a lock while a trainer in another process
publishes as fast as it can, and LoRA adapters folded in on the way."""

from __future__ import annotations

import multiprocessing

import torch

from ebrl.runtime.channel import WeightChannel

SHAPES = {"a.weight": (256, 64), "b.bias": (64,), "c.weight": (2048, 1024)}


def state_of(value: float) -> dict[str, torch.Tensor]:
    return {k: torch.full(shape, value) for k, shape in SHAPES.items()}


def holder(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A module with the state dict SHAPES describes (generation's policy, in miniature)."""
    root = torch.nn.Module()
    for key, shape in SHAPES.items():
        name, param = key.split(".")
        sub = torch.nn.Module()
        sub.register_parameter(param, torch.nn.Parameter(torch.zeros(shape, dtype=dtype)))
        root.add_module(name, sub)
    return root


def publisher(channel: WeightChannel, versions: int) -> None:
    for v in range(1, versions + 1):
        channel.publish(state_of(float(v)))


def test_a_reader_never_sees_a_torn_or_stale_copy() -> None:
    ctx = multiprocessing.get_context("spawn")
    channel = WeightChannel(state_of(0.0), ctx, torch.float32)
    writer = ctx.Process(target=publisher, args=(channel, 300))
    reader, have, seen = holder(), -1, []
    writer.start()
    while have < 300:
        have = channel.pull(reader, have)
        for p in reader.parameters():  # all of one version, the one pull said: no torn or mislabelled copy
            assert torch.equal(p, torch.full_like(p, float(have))), (have, p.unique()[:4])
        seen.append(have)
    writer.join(10)
    assert writer.exitcode == 0 and seen == sorted(seen) and seen[-1] == 300


def test_a_reader_that_lags_behind_several_publications_labels_its_copy_right() -> None:
    """The interleaving that failed once in CI: the reader reads version 18, is descheduled while the trainer
    publishes up to 24 (slot 0 holds 24 again, complete), then checks slot 0's sequence: even, unchanged during
    the copy, so without a second look at the version it returned 24's weights labelled 18."""
    channel = WeightChannel(state_of(0.0), multiprocessing.get_context("spawn"), torch.float32)
    reader = holder()
    for v in range(1, 19):
        channel.publish(state_of(float(v)))
    slot = channel._slot

    def descheduled(index: int) -> torch.Tensor | None:
        channel._slot = slot
        for v in range(19, 25):
            channel.publish(state_of(float(v)))
        return slot(index)

    channel._slot = descheduled
    have = channel.pull(reader, 0)
    assert all(torch.equal(p, torch.full_like(p, float(have))) for p in reader.parameters()) and have == 24


def test_the_payload_is_policy_dtype_and_lora_is_folded_in() -> None:
    ctx = multiprocessing.get_context("spawn")
    # (a LoRA'd weight is frozen, so held in policy.dtype, as the trainer holds it)
    full = {
        "a.weight": torch.randn(256, 64).to(torch.bfloat16),
        "b.bias": torch.randn(64),
        "c.weight": torch.randn(2048, 1024),
    }
    channel = WeightChannel(full, ctx, torch.bfloat16, lora_scaling=2.0)
    assert channel.payload_bytes == sum(v.numel() for v in full.values()) * 2
    generation = holder(torch.bfloat16)
    assert channel.pull(generation, -1) == 0
    assert torch.equal(generation.a.weight, full["a.weight"].to(torch.bfloat16))
    down, up = torch.randn(4, 64), torch.randn(256, 4)
    trainer_state = {
        "a.base_layer.weight": full["a.weight"],
        "a.lora_A.default.weight": down,
        "a.lora_B.default.weight": up,
        "b.bias": full["b.bias"],
        "c.weight": full["c.weight"],
    }
    assert channel.publish(trainer_state) == 1 and channel.pull(generation, 0) == 1
    folded_once = (full["a.weight"].float() + 2.0 * up.bfloat16().float() @ down.bfloat16().float()).bfloat16()
    assert torch.allclose(generation.a.weight.float(), folded_once.float(), rtol=2**-7, atol=1e-3)
    assert torch.equal(generation.c.weight, full["c.weight"].to(torch.bfloat16))
    assert channel.pull(generation, 1) == 1  # nothing newer: nothing copied
