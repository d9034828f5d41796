"""The reference side of the k-of-H parity test: lerobot 0.4.4's own `select_action` queue, closed loop on a real
robosuite Lift, run under lerobot's interpreter (`python -m ebrl.envs.setup lerobot`), never imported by ours.

    python lerobot_queue_reference.py <out folder> <pi0|pi05> <n_action_steps> <steps>

Needs <out>/lerobot/ as lerobot_reference.py writes it (lerobot's save_pretrained of a small PI0Policy / PI05Policy
with its processors). Copies it to <out>/lerobot_queue/ with config.json's n_action_steps set (as a fine-tune that
acts k of each chunk carries it), loads it with lerobot's `from_pretrained` and `make_pre_post_processors`, and runs
<steps> steps of our robosuite Lift adapter (seed 0, agentview at 64 px) on the actions `select_action` pops: a
chunk is predicted when the queue is empty, from the observation then, and its first n_action_steps actions are
queued. The noise of each prediction comes from a seeded generator (lerobot's `sample_noise`, replaced before
anything runs). Writes <out>/queue.safetensors: the actions the env executed (post-processed, before the adapter's
clip), the noises, and the observation before each action (state, image), in order.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from lerobot_reference import lerobot_variant, local_tokenizer  # (this folder: the folder's sizes and tokenizer)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # our robosuite adapter: the env both sides step (numpy and robosuite only)


def main(out: Path, variant: str, k: int, steps: int) -> None:
    from lerobot.policies.factory import make_pre_post_processors

    _, policy_cls, _, _ = lerobot_variant(variant)
    local_tokenizer(str(out / "paligemma_tokenizer.model"), out / "hf_tokenizer")
    folder = out / "lerobot_queue"
    shutil.copytree(out / "lerobot", folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    config["n_action_steps"] = k
    (folder / "config.json").write_text(json.dumps(config, indent=4))

    policy = policy_cls.from_pretrained(str(folder)).eval()
    pre, post = make_pre_post_processors(policy.config, pretrained_path=str(folder))
    g = torch.Generator().manual_seed(2)
    noises: list[torch.Tensor] = []

    def sample_noise(shape, device):
        noises.append(torch.randn(*shape, generator=g))
        return noises[-1].to(device)

    policy.model.sample_noise = sample_noise
    policy.reset()

    from ebrl.envs.robosuite_env import RobosuiteEnv

    env = RobosuiteEnv(task="Lift", cameras=["agentview"], image_size=64, max_episode_steps=200, seed=0)
    obs = env.begin_episode(0)
    actions, states, images = [], [], []
    for _ in range(steps):
        states.append(torch.from_numpy(obs["state"]))
        images.append(torch.from_numpy(obs["image/agentview"]))
        batch = {
            "observation.state": torch.from_numpy(obs["state"][:8])[None],
            "observation.images.base_0_rgb": torch.from_numpy(obs["image/agentview"]).permute(2, 0, 1)[None].float()
            / 255.0,
            "task": [env.spec.instruction],
        }
        with torch.no_grad():
            action = post(policy.select_action(pre(batch)))
        actions.append(action[0].float())
        obs, result = env.run_chunk(action.numpy())  # one action: clipped and stepped as our runtime does
        assert not result.done
    env.close()
    from safetensors.torch import save_file

    save_file(
        {
            "actions": torch.stack(actions),
            "noise": torch.cat(noises),
            "state": torch.stack(states),
            "image": torch.stack(images),
        },
        str(out / "queue.safetensors"),
    )
    print(f"{steps} steps, {len(noises)} chunks predicted, written to {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
