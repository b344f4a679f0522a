"""The benchmark: MQKS beside Redis, NATS and beanstalkd. Run its scripts as modules from the repo root:
`.venv/bin/python -m bench.run` and `.venv/bin/python -m bench.fairness`."""
