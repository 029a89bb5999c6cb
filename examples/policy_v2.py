"""An example policy version: `trialledger replay --policy v2 --policy-file examples/policy_v2.py`.

v2 never probes: a run killed after its first turn is an execution error even with
`verify_after_agent_error` on (v1's probe row is dropped), and a provider's "slow down"
message counts as a model-endpoint error. Everything else is v1.
"""

from trialledger.core.policy import V1, V1_CLASSIFICATION, Policy, contains, register_policy

register_policy(Policy(
    name="v2",
    rules=tuple(rule for rule in V1.rules if rule.name != "probe"),
    classification=(*V1_CLASSIFICATION, ("model_endpoint", contains("slow down"))),
))
