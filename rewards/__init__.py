"""Reward functions for reward.functions in params.yaml (docs/ppo.md#reward-functions): dvc.yaml lists this folder
among the deps of every stage that scores with the training reward, so editing a function here reruns them."""
