"""What every HTTP rollout-server engine needs (SGLang and vLLM are built on it): the async HTTP client with
retries and backoff, process supervision, weight bucketing and transports."""
