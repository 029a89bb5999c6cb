"""An example policy version: `trialledger replay --db trials.db --all --diff --policy
no-probe --policy-file examples/policy_no_probe.py`.

`no-probe` never probes: a run killed after its first turn is an execution error even with
`verify_after_agent_error` on (the probe row is dropped), and a provider's "slow down"
message counts as a model-endpoint error. Everything else is v2.
"""

from trialledger.core.policy import V1_CLASSIFICATION, V2, Policy, contains, register_policy

register_policy(Policy(
    name="no-probe",
    rules=tuple(rule for rule in V2.rules if rule.name != "probe"),
    classification=(*V1_CLASSIFICATION, ("model_endpoint", contains("slow down"))),
))
