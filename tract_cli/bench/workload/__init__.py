"""The workload driver of `tract bench`: requests, their arrivals, the runner's worker processes and their transports."""
