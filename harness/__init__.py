"""What tests and benchmarks share to run kvserve for real: processes started by the project's
own code and stopped by their PID (`launch.py`: kvserve, any command; `cluster.py`: a KV store
and vllm-router), an SSE client that times every event (`sse.py`), and the prompts they send
(`workload.py`). Traffic goes to loopback addresses only."""
