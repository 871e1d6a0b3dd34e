"""The aws backend: torchrun on EC2 instances in Auto Scaling Groups, with cloud replacement (a
retired node's instance terminated through its group, the replacement joining as a spare after
its preflight). boto3 (the `aws` extra) is imported only when the first client is built."""

from trainguard.controller.backends.aws.backend import AwsBackend, build
from trainguard.controller.backends.base import BackendKind

KIND = BackendKind(name=AwsBackend.name, capabilities=AwsBackend.capabilities, factory=build)

__all__ = ["KIND"]
