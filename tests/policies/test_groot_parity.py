"""GR00TPolicy against lerobot 0.4.4's GR00T N1.5 (`lerobot.policies.groot`), and the checkpoint layouts it loads.

The parity tests run tests/policies/groot_reference.py under the lerobot venv (`python -m ebrl.envs.setup lerobot`):
it builds lerobot's GR00TN15 at our small preset's sizes (3 embodiment slots) with random weights, saves it as
NVIDIA's release is laid out (sharded safetensors + index) and as a lerobot fine-tune (GrootPolicy.save_pretrained),
and records the backbone's features and the velocity at every Euler step and the denoised chunk of get_action. Ours
loads each file through `load_weights` and must match in float32: the velocity (ours = minus GR00T's, FlowPolicy's
sign) at the same actions and times, and the chunk of a plain Euler chain from the same noise.
The layout tests need no venv: files built by NVIDIA's and lerobot's naming rules from our own tensors.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest
import torch

from ebrl.envs.setup import venv_dir, venv_python
from ebrl.policies.gr00t import PRESETS, GR00TPolicy
from ebrl.policies.weights import CheckpointError, load_weights
from tests.policies.test_families import make_spec

REFERENCE = Path(__file__).with_name("groot_reference.py")
LEROBOT = venv_python(venv_dir("lerobot"))
BATCH, STEPS, EMBODIMENT, SLOTS = 2, 4, 1, 3
TOLERANCE = 1e-4


def parity_policy(monkeypatch: pytest.MonkeyPatch, cameras: tuple[str, ...] = ("front",)) -> GR00TPolicy:
    """Our small preset with 3 embodiment slots (embodiment 1 at run time: the slot choice is tested too)."""
    monkeypatch.setitem(PRESETS, "parity", dataclasses.replace(PRESETS["small"], embodiments=SLOTS))
    d = PRESETS["parity"]
    spec = make_spec(cameras, size=d.image_size, state_dim=d.max_state_dim)
    with torch.device("meta"):  # the weights all come from the file
        policy = GR00TPolicy(spec, preset="parity", embodiment_id=EMBODIMENT, denoise_steps=STEPS)
    policy.to_empty(device="cpu")
    with torch.no_grad():
        for prefix in policy.rl_heads():  # what no GR00T file has
            policy.init_head(prefix)
    return policy.eval()


@pytest.fixture(scope="module")
def reference(groot_reference: Path) -> Path:
    """tests/conftest.py's groot_reference."""
    return groot_reference


def make_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """groot_reference.py's folders and io.safetensors (skipped without lerobot's interpreter)."""
    if not LEROBOT.is_file():
        pytest.skip(f"no lerobot venv at {LEROBOT}: run `python -m ebrl.envs.setup lerobot` for the GR00T parity tests")
    out = tmp_path_factory.mktemp("groot")
    d = dataclasses.asdict(dataclasses.replace(PRESETS["small"], embodiments=SLOTS))
    d["image_token"] = d["vocab"] - 1  # byte 255's id: no ASCII instruction token
    spec = {
        "dims": d,
        "batch": BATCH,
        "chunk": PRESETS["small"].chunk,
        "steps": STEPS,
        "seed": 0,
        "embodiment_id": EMBODIMENT,
        "text_tokens": 10,
        "vl_tokens": 12,
    }
    (out / "spec.json").write_text(json.dumps(spec))
    done = subprocess.run(
        [str(LEROBOT), str(REFERENCE), str(out / "spec.json"), str(out)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def io(reference: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(reference / "io.safetensors"))


def chain(policy: GR00TPolicy, cond: dict, x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our velocities at lerobot's recorded actions x (B, K, H, D) and timesteps t (B, K) (t / 1000 = GR00T's time
    = 1 - FlowPolicy's), and the chunk of a plain Euler chain from x[:, 0] over all dims, GR00T's sampling."""
    ts = 1.0 - t[0] / 1000.0
    v = torch.stack([policy.velocity(x[:, k], ts[k].expand(x.shape[0]), cond)[0] for k in range(x.shape[1])], 1)
    y = x[:, 0]
    for k in range(policy.denoise_steps):
        y = (
            y
            - policy.velocity(y, policy.times(policy.denoise_steps, y.device)[k].expand(y.shape[0]), cond)[0]
            / policy.denoise_steps
        )
    return v, y


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["nvidia", "lerobot", "lerobot_tied"])
def test_action_head_matches_lerobot(reference: Path, layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if layout == "lerobot_tied":  # (lerobot's own save of a tied model: lm_head is all the file has of the two)
        from safetensors import safe_open

        names = set(safe_open(str(reference / layout / "model.safetensors"), "pt").keys())
        assert {f"_groot_model.{k}" for k in GR00TPolicy.TIED} & names == {f"_groot_model.{GR00TPolicy.TIED[1]}"}
    policy = parity_policy(monkeypatch)
    assert load_weights(policy, str(reference / layout)) == policy.rl_heads()  # the file has all but the RL heads
    ref = io(reference)
    with torch.no_grad():
        features = ref["head_features"]
        cond, _ = policy.encode_features(features, torch.ones(features.shape[:2], dtype=torch.bool), ref["state"])
        v, chunk = chain(policy, cond, ref["head_x"], ref["head_t"])
    assert ref["head_t"][0].tolist() == [0.0, 250.0, 500.0, 750.0]
    assert (v + ref["head_v"]).abs().max() <= TOLERANCE  # FlowPolicy's velocity is minus GR00T's
    assert (chunk - ref["head_chunk"]).abs().max() <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["nvidia", "lerobot_tied"])  # (the tied file's embed_tokens is its lm_head)
def test_backbone_and_whole_model_match_lerobot(reference: Path, layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    policy = parity_policy(monkeypatch)
    load_weights(policy, str(reference / layout))
    ref = io(reference)
    patches = (policy.dims.image_size // policy.dims.patch_size) ** 2
    tokens = ref["input_ids"][:, patches:]
    with torch.no_grad():
        vl, mask = policy.backbone_features(ref["pixel_values"], tokens, torch.ones_like(tokens, dtype=torch.bool))
        assert (vl - ref["backbone_features"]).abs().max() <= TOLERANCE
        cond, _ = policy.encode_features(vl, mask, ref["state"])
        v, chunk = chain(policy, cond, ref["full_x"], ref["full_t"])
    assert (v + ref["full_v"]).abs().max() <= TOLERANCE
    assert (chunk - ref["full_chunk"]).abs().max() <= TOLERANCE


# --- layouts, without the venv ------------------------------------------------------------------
def published(policy: GR00TPolicy) -> dict[str, torch.Tensor]:
    """Our tensors as a released GR00T N1.5 names them: everything but the RL heads, plus what N1.5 ships and never
    runs (lm_head, SigLIP's pooling head)."""
    state = {k: v.clone() for k, v in policy.state_dict().items() if not k.startswith(tuple(policy.rl_heads()))}
    width, vit = policy.dims.width, policy.dims.vit_width
    state["backbone.eagle_model.language_model.lm_head.weight"] = torch.randn(policy.dims.vocab, width)
    state["backbone.eagle_model.vision_model.vision_model.head.probe"] = torch.randn(1, 1, vit)
    return state


def save_sharded(state: dict[str, torch.Tensor], folder: Path, shards: int = 3) -> None:
    """transformers' sharded layout: model-0000N-of-0000M.safetensors and model.safetensors.index.json."""
    from safetensors.torch import save_file

    folder.mkdir()
    keys, weight_map = sorted(state), {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[i::shards]
        save_file({k: state[k].contiguous() for k in part}, str(folder / name))
        weight_map.update({k: name for k in part})
    total = sum(v.numel() * v.element_size() for v in state.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )


def fresh(cameras: tuple[str, ...] = ("front",)) -> GR00TPolicy:
    torch.manual_seed(1)
    return GR00TPolicy(make_spec(cameras))


def test_nvidia_and_lerobot_layouts_load(tmp_path: Path, one_thread) -> None:
    source = fresh()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(torch.randn_like(p))
    state = published(source)
    save_sharded(state, tmp_path / "nvidia")
    from safetensors.torch import save_file

    (tmp_path / "lerobot").mkdir()
    save_file(
        {f"_groot_model.{k}": v.contiguous() for k, v in state.items()}, str(tmp_path / "lerobot" / "model.safetensors")
    )
    for layout in ("nvidia", "lerobot"):
        target = fresh()
        assert load_weights(target, str(tmp_path / layout)) == target.rl_heads()
        loaded = target.state_dict()
        for key, value in source.state_dict().items():
            if not key.startswith(tuple(target.rl_heads())):
                assert torch.equal(loaded[key], value), (layout, key)
    state_only = fresh(())  # a state-only env builds no vision tower: the file's is left out
    assert load_weights(state_only, str(tmp_path / "nvidia")) == state_only.rl_heads()


def test_a_lerobot_fine_tune_of_a_tied_model_loads(tmp_path: Path, one_thread) -> None:
    """N1.5's config ties Qwen3's lm_head to embed_tokens; lerobot's save_pretrained writes through safetensors'
    save_model, which keeps one name of a shared tensor, the first in sorted order: lm_head. Here our small model
    with that tie (and without the RL heads a lerobot model lacks) is written by save_model under `_groot_model.`."""
    from safetensors import safe_open
    from safetensors.torch import save_model

    source = fresh()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(torch.randn_like(p))
    language_model = source.backbone.eagle_model.language_model
    language_model.lm_head = torch.nn.Linear(source.dims.width, source.dims.vocab, bias=False)
    language_model.lm_head.weight = language_model.model.embed_tokens.weight
    for head in source.rl_heads():
        delattr(source, head)
    lerobot = torch.nn.Module()
    lerobot._groot_model = source
    save_model(lerobot, str(tmp_path / "model.safetensors"))
    embed, head = GR00TPolicy.TIED
    assert {f"_groot_model.{head}"} == {
        k for k in safe_open(str(tmp_path / "model.safetensors"), "pt").keys() if k.endswith((embed, head))
    }
    target = fresh()
    assert load_weights(target, str(tmp_path)) == target.rl_heads()
    assert torch.equal(target.state_dict()[embed], language_model.model.embed_tokens.weight)


def test_a_wrong_file_is_one_line(tmp_path: Path, one_thread) -> None:
    from safetensors.torch import save_file

    policy = fresh()
    state = published(policy)
    state["action_head.state_encoder.layer1.W"] = torch.zeros(32, 64, 48)  # another preset's shape
    del state["action_head.future_tokens.weight"]
    state["action_head.model.transformer_blocks.0.attn1.to_out.weight"] = torch.zeros(48, 48)  # not GR00T's name
    save_file(state, str(tmp_path / "wrong.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_weights(policy, str(tmp_path / "wrong.safetensors"))
    message = str(err.value)
    assert "\n" not in message
    assert "action_head.future_tokens.weight" in message and "to_out.weight" in message
    assert "action_head.state_encoder.layer1.W (32, 64, 48)" in message


def test_embodiment_id_is_checked() -> None:
    from ebrl.config import ConfigError

    with pytest.raises(ConfigError, match="policy.embodiment_id=1 "):
        GR00TPolicy(make_spec(), embodiment_id=1)  # tiny has one slot
