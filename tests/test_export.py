"""`python -m ebrl.export` against the code that reads what it writes: lerobot 0.4.4's PI0Policy / PI05Policy (their
own from_pretrained and processors, in lerobot's interpreter) and our own loader.

Each run is made as a training run would leave it, cheaply: our policy built from a reference folder of
tests/conftest.py's `lerobot_references` (`policy.checkpoint`), some weights moved as training moves them, written by
`checkpoint_record` and `atomic_save` as checkpoints/last.pt. Its exports are loaded by lerobot in one run of its
interpreter (lerobot_reference.py act; the lerobot layout in the default suite, openpi's slow) and act on the
reference's batch with its noise; lerobot's deterministic chunk and its post-processed actions must be ours, and our
loader, given the exported folder, must act as the run did.
- pi0 from lerobot's folder, trained with LoRA (policy.train=lora: the export folds the adapters in), executing 3
  of 6 actions (policy.execute -> n_action_steps), normalised with statistics of its own (policy.norm_stats, an
  openpi norm_stats.json: the export writes them for lerobot's formulas); written as lerobot's (its own layout, with
  --keep-heads) and as openpi's;
- pi0.5 from openpi's converter layout, all weights trained; written as openpi's (its own) and as lerobot's (config
  and processors made from nothing);
- pi0 from lerobot's first layout (February 2025, test_lerobot_parity.first_lerobot_layout) as published, without
  processors or statistics; written as lerobot 0.4's;
- pi0 from lerobot 0.6.1's layout (test_lerobot_parity.lerobot_061_layout: lm_head and embed_tokens both saved, as
  two tensors); written as lerobot's (both names, two copies) and as openpi's (lm_head alone).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ebrl.envs.setup import benchmark_python
from ebrl.export import HEADS, export, main
from ebrl.policies.build import build_policy
from ebrl.policies.gr00t import GR00TPolicy
from ebrl.policies.openpi import OpenPIPolicy
from ebrl.runtime.checkpoint import atomic_save, checkpoint_record
from tests.conftest import ONE_THREAD, REPO
from tests.policies.test_lerobot_parity import REFERENCE, first_lerobot_layout, lerobot_061_layout, ours_config
from tests.runtime.test_disk_full import small_disk  # noqa: F401  (a fixture: a real small tmpfs)

TOLERANCE = 1e-4
# case -> (run, --to, --keep-heads); the lerobot cases act in lerobot in the default suite, the others slow
EXPORTS = {
    "pi0_lerobot": ("pi0", None, True),
    "pi0_openpi": ("pi0", "openpi", False),
    "pi05_openpi": ("pi05", None, False),
    "pi05_lerobot": ("pi05", "lerobot", False),
    "pi0feb_lerobot_slow": ("pi0feb", None, False),
    "pi0v061_lerobot": ("pi0v061", None, False),
    "pi0v061_openpi": ("pi0v061", "openpi", False),
}
LEROBOT_DEFAULT = ["pi0_lerobot", "pi05_lerobot", "pi0v061_lerobot"]


@pytest.fixture(scope="module", autouse=True)
def one_thread_here():
    """tests/conftest.py's one_thread for the whole module: its fixtures run the policies too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def observations(policy: torch.nn.Module, ref: dict[str, torch.Tensor], tasks: list[str]) -> dict[str, torch.Tensor]:
    """The reference's batch as our env gives it (its third camera slot has no env camera)."""
    tokens, mask = policy.tokenize(tasks)
    return {
        "state": ref["state"],
        "image/agentview": ref["image/base_0_rgb"],
        "image/wrist": ref["image/left_wrist_0_rgb"],
        "tokens": torch.from_numpy(tokens),
        "token_mask": torch.from_numpy(mask),
    }


def act(policy: torch.nn.Module, folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(model chunk in the normalised space, env actions) of a deterministic chunk from the reference's noise."""
    ref = load_file(str(folder / "reference.safetensors"))
    meta = json.loads((folder / "reference.json").read_text())
    sample = policy.sample(observations(policy, ref, meta["tasks"]), deterministic=True, noise=ref["noise"])
    return sample.extras["chain"][:, -1, :, : meta["action_dim"]], sample.chunk


def other_stats(folder: Path, path: Path) -> str:
    """An openpi norm_stats.json unlike the reference folder's: what the pi0 run normalised with instead."""
    rng = np.random.default_rng(3)
    meta = json.loads((folder / "reference.json").read_text())
    table = {
        name: {
            "mean": rng.normal(size=n).tolist(),
            "std": (rng.random(n) + 0.3).tolist(),
            "q01": (-1 - rng.random(n)).tolist(),
            "q99": (1 + rng.random(n)).tolist(),
        }
        for name, n in (("state", meta["state_dim"]), ("actions", meta["action_dim"]))
    }
    path.write_text(json.dumps({"norm_stats": table}))
    return str(path)


def make_run(folder: Path, run: Path, layout: str, **overrides) -> tuple[torch.Tensor, torch.Tensor]:
    """A run folder of ours whose policy started from the reference's `layout` and was 'trained': returns what it
    acts (model chunk, actions)."""
    cfg, spec = ours_config(folder, layout, **overrides)
    torch.manual_seed(0)
    policy = build_policy(cfg, spec, train=True)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if p.requires_grad and (
                "lora_B" in name or "action_out_proj" in name or "lora" not in (cfg.get("train") or "")
            ):
                p.add_(torch.randn_like(p) * 0.02)
    conf = {"policy": cfg, "env": {"name": "libero", "cameras": ["agentview", "wrist"]}}
    atomic_save(checkpoint_record(conf, policy.state_dict(), {}, 1, 100, None), run / "checkpoints" / "last.pt")
    with torch.no_grad():
        return act(policy, folder)


@pytest.fixture(scope="module")
def exported(lerobot_references, tmp_path_factory) -> dict[str, dict]:
    """Each case of EXPORTS: the exported folder, what the run acts, its reference folder."""
    root = tmp_path_factory.mktemp("export")
    pi0, pi05 = lerobot_references["pi0"], lerobot_references["pi05"]
    first_lerobot_layout(pi0, "lerobot_feb2025_base")
    for f in (pi0 / "lerobot_feb2025_base").glob("policy_*"):  # (that layout has no processors: no statistics)
        f.unlink()
    lerobot_061_layout(pi0)
    runs = {
        "pi0": make_run(
            pi0,
            root / "pi0_run",
            "lerobot",
            train="lora",
            lora_rank=2,
            lora_alpha=4,
            execute=3,
            norm_stats=other_stats(pi0, root / "norm_stats.json"),
        ),
        "pi05": make_run(pi05, root / "pi05_run", "openpi", denoise_steps=3, prompt_style="lerobot"),
        "pi0feb": make_run(pi0, root / "pi0feb_run", "lerobot_feb2025_base"),
        "pi0v061": make_run(pi0, root / "pi0v061_run", "lerobot_0.6.1"),
    }
    return {
        case: {
            "variant": "pi05" if run == "pi05" else "pi0",
            "run": runs[run],
            "folder": export(root / f"{run}_run", to, root / case, keep_heads),
            "reference": pi05 if run == "pi05" else pi0,
        }
        for case, (run, to, keep_heads) in EXPORTS.items()
    }


def lerobot_acts(exported: dict[str, dict], cases: list[str]) -> dict[str, dict]:
    """What lerobot acts from each case's folder, in one run of its interpreter: (model chunk, actions) and the
    record of the tensors it holds otherwise than the file."""
    root = next(iter(exported.values()))["folder"].parent
    job = {
        "tokenizer": str(exported[cases[0]]["reference"] / "paligemma_tokenizer.model"),
        "cases": [
            {
                "variant": exported[c]["variant"],
                "folder": str(exported[c]["folder"]),
                "reference": str(exported[c]["reference"]),
                "out": str(root / f"{c}.safetensors"),
            }
            for c in cases
        ],
    }
    (root / "job.json").write_text(json.dumps(job))
    done = subprocess.run(
        [str(benchmark_python("lerobot")), str(REFERENCE), "act", str(root / "job.json")],
        capture_output=True,
        text=True,
        timeout=600,
        env=ONE_THREAD,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = {}
    for case in cases:
        with safe_open(str(root / f"{case}.safetensors"), "pt") as handle:
            out[case] = {
                "acts": (handle.get_tensor("model_chunk"), handle.get_tensor("actions")),
                "meta": handle.metadata(),
            }
    return out


@pytest.fixture(scope="module")
def lerobot_layout(exported) -> dict[str, dict]:
    return lerobot_acts(exported, LEROBOT_DEFAULT)


def assert_lerobot_acts_as_the_run(exported: dict[str, dict], theirs: dict[str, dict]) -> None:
    for case, lerobot in theirs.items():
        model_chunk, actions = exported[case]["run"]
        # lerobot loaded every tensor of the file (only the embedding it ties to lm_head is not in it, but where the
        # source was lerobot 0.6's, which holds both)
        untied = case.startswith("pi0v061_lerobot")
        assert json.loads(lerobot["meta"]["differ"]) == ([] if untied else ["model." + OpenPIPolicy.TIED[0]]), case
        assert (lerobot["acts"][0] - model_chunk).abs().max() < TOLERANCE, case
        assert (lerobot["acts"][1] - actions).abs().max() < TOLERANCE * max(1.0, actions.abs().max().item()), case


def test_lerobot_acts_its_layout_as_the_run(exported, lerobot_layout) -> None:
    assert_lerobot_acts_as_the_run(exported, lerobot_layout)
    assert lerobot_layout["pi0_lerobot"]["meta"]["n_action_steps"] == "3"  # policy.execute


@pytest.mark.slow
def test_lerobot_acts_the_other_exports_as_the_run(exported) -> None:
    """openpi's layout, and the first lerobot layout without statistics written as lerobot 0.4's (its config and
    processors made from nothing, normalising nothing)."""
    assert_lerobot_acts_as_the_run(exported, lerobot_acts(exported, [c for c in EXPORTS if c not in LEROBOT_DEFAULT]))


@pytest.mark.parametrize("case", list(EXPORTS))
def test_our_loader_acts_as_the_run(exported, case) -> None:
    c = exported[case]
    model_chunk, actions = c["run"]
    # from the exported folder alone (openpi's records say neither the steps nor how the prompts were made)
    openpi_layout = {"denoise_steps": 3, "prompt_style": "lerobot"} if case.endswith("openpi") else {}
    cfg, spec = ours_config(c["reference"], "unused", checkpoint=str(c["folder"]), tokenizer=None, **openpi_layout)
    again = act(build_policy(cfg, spec), c["reference"])
    assert (again[0] - model_chunk).abs().max() < 1e-5, case
    assert (again[1] - actions).abs().max() < 1e-5 * max(1.0, actions.abs().max().item()), case


def test_what_the_folders_hold(exported) -> None:
    pi0, as_openpi = exported["pi0_lerobot"], exported["pi0_openpi"]
    config = json.loads((pi0["folder"] / "config.json").read_text())
    assert config["n_action_steps"] == 3 and config["chunk_size"] == 6
    source = set(safe_open(str(pi0["reference"] / "lerobot" / "model.safetensors"), "pt").keys())
    assert set(safe_open(str(pi0["folder"] / "model.safetensors"), "pt").keys()) == source
    assert set(safe_open(str(as_openpi["folder"] / "model.safetensors"), "pt").keys()) == {
        k.removeprefix("model.") for k in source
    }
    heads = load_file(str(pi0["folder"] / HEADS))  # (--keep-heads)
    assert {k.split(".")[0] for k in heads} == {"value_head", "noise_std_head"}
    assert not (as_openpi["folder"] / HEADS).exists()
    assert (pi0["folder"] / "paligemma_tokenizer.model").is_file()  # the run's tokenizer, for our loader
    assert [p.name for p in (exported["pi05_openpi"]["folder"] / "assets").iterdir()] == ["test_robot"]


def test_a_lerobot_061_source_is_written_with_both_names_for_lerobot_and_lm_head_alone_for_openpi(exported) -> None:
    """lerobot 0.6 loads both names (untied); openpi's strict safetensors.load_model of its tied PaliGemma refuses
    the second name of the pair."""
    embed, head = OpenPIPolicy.TIED
    as_lerobot = load_file(str(exported["pi0v061_lerobot"]["folder"] / "model.safetensors"))
    assert set(as_lerobot) == set(
        safe_open(str(exported["pi0v061_lerobot"]["reference"] / "lerobot_0.6.1" / "model.safetensors"), "pt").keys()
    )
    assert torch.equal(as_lerobot["model." + embed], as_lerobot["model." + head])  # the run's embedding, twice
    as_openpi = set(safe_open(str(exported["pi0v061_openpi"]["folder"] / "model.safetensors"), "pt").keys())
    assert head in as_openpi and embed not in as_openpi


def test_bad_input_is_one_line_and_exit_2(exported, tmp_path, capsys) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ebrl.export", str(tmp_path)], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "holds no checkpoint" in done.stderr
    run = exported["pi0_lerobot"]["folder"].parent / "pi0_run"
    record = torch.load(run / "checkpoints" / "last.pt", weights_only=False)
    scratch = tmp_path / "scratch"
    record["config"]["policy"]["checkpoint"] = None
    atomic_save(record, scratch / "checkpoints" / "last.pt")
    oft = tmp_path / "oft"
    record["config"]["policy"].update(name="openvla_oft", _target_="ebrl.policies.openvla_oft.OpenVLAOFTPolicy")
    atomic_save(record, oft / "checkpoints" / "last.pt")
    broken = tmp_path / "broken"
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "model.safetensors").write_bytes(b"not a safetensors file")
    record["config"]["policy"].update(
        name="openpi", _target_="ebrl.policies.openpi.OpenPIPolicy", checkpoint=str(tmp_path / "garbage")
    )
    atomic_save(record, broken / "checkpoints" / "last.pt")
    (tmp_path / "a_file").write_text("")
    for argv, line in (
        ([str(run), "--out", str(exported["pi0_lerobot"]["folder"])], "exists and is not empty"),
        ([str(scratch)], "trained from no published checkpoint"),
        ([str(oft)], "policy.name=openvla_oft cannot be exported"),
        ([str(broken)], "model.safetensors, a file of policy.checkpoint="),
        ([str(run), "--out", str(tmp_path / "a_file" / "out")], "cannot be made there"),
    ):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.count("\n") == 1 and line in err, err


def test_any_other_failure_is_one_line_and_exit_1(exported, small_disk, capsys) -> None:
    """A disk that fills while the export writes (a real 1 MiB tmpfs): one line naming the error and the file its
    traceback went to, and no partial folder left."""
    run = exported["pi0_lerobot"]["folder"].parent / "pi0_run"
    with pytest.raises(SystemExit) as stop:
        main([str(run), "--out", str(small_disk / "out")])
    err = capsys.readouterr().err
    assert stop.value.code == 1 and err.count("\n") == 1 and "the export failed: " in err, err
    assert "(traceback in " in err and "Traceback" not in err
    assert list(small_disk.iterdir()) == []


# --- GR00T ---------------------------------------------------------------------------------------------------------
GROOT_EMBODIMENT = 2  # (lerobot's groot names slot 2 so100: the export writes its tag)


@pytest.fixture(scope="module")
def groot(groot_reference, tmp_path_factory) -> dict[str, dict]:
    """Two GR00T runs from test_groot_parity's reference at its small size: from lerobot's save of a tied model with
    LoRA, and from NVIDIA's release layout with every weight trained (its export's config is made from nothing).
    Each: what the run's policy, lerobot's GrootPolicy.from_pretrained of the export and our loader of it act on the
    reference's inputs, from the noise lerobot's chain started from."""
    import dataclasses

    from ebrl.policies.gr00t import PRESETS
    from tests.policies.test_families import make_spec
    from tests.policies.test_groot_parity import LEROBOT, SLOTS, chain
    from tests.policies.test_groot_parity import REFERENCE as GROOT_REFERENCE

    ref = groot_reference
    root = tmp_path_factory.mktemp("groot_export")
    io = load_file(str(ref / "io.safetensors"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(PRESETS, "parity", dataclasses.replace(PRESETS["small"], embodiments=SLOTS))
        d = PRESETS["parity"]
        spec = make_spec(("front",), size=d.image_size, state_dim=d.max_state_dim)
        tokens = io["input_ids"][:, (d.image_size // d.patch_size) ** 2 :]

        def chunk(policy: torch.nn.Module, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                vl, mask = policy.backbone_features(io["pixel_values"], tokens, torch.ones_like(tokens, dtype=bool))
                return chain(policy, policy.encode_features(vl, mask, io["state"])[0], x, t)[1]

        cfg = {
            "_target_": "ebrl.policies.gr00t.GR00TPolicy",
            "name": "gr00t",
            "preset": "parity",
            "dtype": "float32",
            "embodiment_id": GROOT_EMBODIMENT,
            "denoise_steps": 4,
        }
        runs = {}
        for source, train in (("lerobot_tied", {"train": "lora", "lora_rank": 2, "lora_alpha": 4}), ("nvidia", {})):
            run_cfg = {**cfg, "checkpoint": str(ref / source), **train}
            torch.manual_seed(0)
            policy = build_policy(run_cfg, spec, train=True)
            with torch.no_grad():
                for name, p in policy.named_parameters():
                    if p.requires_grad and (not train or "lora_B" in name or name.startswith("action_head.")):
                        p.add_(torch.randn_like(p) * 0.02)
            conf = {"policy": {**run_cfg, "execute": 8}, "env": {"name": "libero", "cameras": ["front"]}}
            atomic_save(
                checkpoint_record(conf, policy.state_dict(), {}, 1, 100, None),
                root / source / "checkpoints" / "last.pt",
            )
            runs[source] = {"policy": policy, "folder": export(root / source)}
        job = {
            "io": str(ref / "io.safetensors"),
            "cases": [
                {
                    "folder": str(r["folder"]),
                    "embodiment_id": GROOT_EMBODIMENT,
                    "seed": 5,
                    "out": str(root / f"{source}.safetensors"),
                }
                for source, r in runs.items()
            ],
        }
        (root / "job.json").write_text(json.dumps(job))
        done = subprocess.run(
            [str(LEROBOT), str(GROOT_REFERENCE), "act", str(ref / "spec.json"), str(root / "job.json")],
            capture_output=True,
            text=True,
            timeout=600,
            env=ONE_THREAD,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        for source, r in runs.items():
            with safe_open(str(root / f"{source}.safetensors"), "pt") as handle:
                theirs = {k: handle.get_tensor(k) for k in handle.keys()}
                r["meta"] = handle.metadata()
            r["lerobot"] = theirs["full_chunk"]
            r["ours"] = chunk(r.pop("policy"), theirs["full_x"], theirs["full_t"])
            again = build_policy({**cfg, "checkpoint": str(r["folder"])}, spec)
            r["again"] = chunk(again, theirs["full_x"], theirs["full_t"])
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("source", ["lerobot_tied", "nvidia"])
def test_groot_exports_act_as_the_run_in_lerobot_and_ours(groot, source) -> None:
    r = groot[source]
    embed, head = (f"_groot_model.{k}" for k in GR00TPolicy.TIED)
    names = set(safe_open(str(r["folder"] / "model.safetensors"), "pt").keys())
    assert {embed, head} <= names  # (lerobot's from_pretrained leaves them apart: it needs both)
    assert json.loads(r["meta"]["differ"]) == [] and r["meta"]["n_action_steps"] == "8"
    assert (r["lerobot"] - r["ours"]).abs().max() < TOLERANCE, source
    assert (r["again"] - r["ours"]).abs().max() < 1e-5, source
    config = json.loads((r["folder"] / "config.json").read_text())
    assert config["embodiment_tag"] == "so100" and config["chunk_size"] == 16


def test_a_groot_run_from_nvidias_layout_reads_back(tmp_path, monkeypatch) -> None:
    """Without lerobot (the slow test above loads it there too): a tiny GR00T run from NVIDIA's layout (sharded, no
    lm_head) is written in lerobot's groot layout, config made from nothing, and our loader reads the run's weights
    back from it."""
    import dataclasses

    from ebrl.policies.gr00t import PRESETS
    from tests.policies.test_families import make_spec
    from tests.policies.test_groot_parity import published, save_sharded

    monkeypatch.setitem(PRESETS, "tiny3", dataclasses.replace(PRESETS["tiny"], embodiments=3))
    cfg = {
        "_target_": "ebrl.policies.gr00t.GR00TPolicy",
        "name": "gr00t",
        "preset": "tiny3",
        "dtype": "float32",
        "embodiment_id": GROOT_EMBODIMENT,
    }
    spec = make_spec(("front",))
    torch.manual_seed(0)
    base = build_policy(cfg, spec)
    state = published(base)
    del state[GR00TPolicy.TIED[1]]  # (transformers' save_pretrained leaves the tied lm_head out)
    save_sharded(state, tmp_path / "nvidia")
    cfg["checkpoint"] = str(tmp_path / "nvidia")
    trained = build_policy(cfg, spec)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    conf = {"policy": cfg, "env": {"name": "robosuite", "cameras": ["front"]}}
    atomic_save(
        checkpoint_record(conf, trained.state_dict(), {}, 1, 100, None), tmp_path / "run" / "checkpoints" / "last.pt"
    )
    folder = export(tmp_path / "run")
    assert folder == tmp_path / "run" / "export" / "lerobot"
    names = set(safe_open(str(folder / "model.safetensors"), "pt").keys())
    assert (
        all(k.startswith("_groot_model.") for k in names) and {f"_groot_model.{k}" for k in GR00TPolicy.TIED} <= names
    )
    config = json.loads((folder / "config.json").read_text())
    assert config["type"] == "groot" and config["base_model_path"] == str((tmp_path / "nvidia").resolve())
    assert config["embodiment_tag"] == "so100" and list(config["input_features"]) == ["observation.images.front"]
    again = build_policy({**cfg, "checkpoint": str(folder)}, spec).state_dict()
    heads = tuple(trained.rl_heads())
    assert all(torch.equal(again[k], v) for k, v in trained.state_dict().items() if not k.startswith(heads))
