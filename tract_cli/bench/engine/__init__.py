"""Runs on a real serving engine (`tract bench --engine vllm`): each KV path as a vLLM configuration, on the same prompts."""
