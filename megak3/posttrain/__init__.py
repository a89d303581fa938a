"""Post-training: RL with partial rollouts (SFT is the trainer on chat data).

The data pieces live in megak3/data/: chat.py (the chat template and its training mask), sft.py (chat
JSON lines -> SFT indexed dataset + mask twin -> packed rows of whole conversations), demo_sft.py (the
built-in chat corpus, data=demo_sft, and its verifiable tasks).

    objective.py  group advantages, truncated per-token staleness weights, the clipped policy loss
    rewards.py    exact answers, the effort-control override, MOPD's per-token reward
    tasks.py      task mixtures with domain/effort tags (rl.tasks), user reward functions (rl.reward)
    mopd.py       MOPD teachers by domain tag: checked against the student, each scoring its own rows
    teacher_client.py  a MOPD teacher served over HTTP (TAG=http://HOST:PORT): start check, echo scoring, strict parsing
    buffer.py     rollouts with a policy version and a behaviour logprob per token; the rollout buffer
    rollout.py    partial rollouts on the in-process engine (pause / resume with caches kept)
    rl.py         the RL loop (RLRunner): generate, reward, update through RankStep, refit
    update.py     the policy update at any trainer layout (dp, tp+SP, pp with every schedule, cp, ep)
    engines.py    rollout engine replicas with their own layout (rl.rollout.*), colocated on the trainer's ranks
    refit.py      the refit by in-memory resharding: trainer boxes -> every engine rank's boxes
    checkpoint.py RL checkpoints in the checkpoint package (policy, optimizer, RL state; journal of finished samples)
    __main__.py   python -m megak3.posttrain: RL from a checkpoint, with a shuffled-reward control
"""
