"""gateway-bench: agent-session workloads, runner, comparison and charts."""
