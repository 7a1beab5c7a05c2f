"""Authorization policies by key, indexed the way evaluation needs them (upstream ``state/policy.rs``).

Global policies are indexed under the namespace ``""``; namespace-scoped ones under their namespace; policies with
``WorkloadSelector`` scope are reached only through the workload's ``authorization_policies`` list. Evaluation then
looks at only the policies that can apply, whatever the total (10,000 policies elsewhere cost nothing).
"""

from __future__ import annotations

from collections.abc import Iterator

from ztunnel.rbac import Authorization, Plan, Scope


class PolicyStore:
    def __init__(self) -> None:
        self.by_key: dict[str, Authorization] = {}
        self._by_namespace: dict[str, dict[str, Authorization]] = {}
        # Evaluation plans per (namespace, the workload's own policy keys); dropped whenever a policy changes.
        self._plans: dict[tuple[str, tuple[str, ...]], Plan] = {}

    def __len__(self) -> int:
        return len(self.by_key)

    def __iter__(self) -> Iterator[Authorization]:
        return iter(self.by_key.values())

    def get(self, key: str) -> Authorization | None:
        return self.by_key.get(key)

    def in_namespace(self, namespace: str) -> dict[str, Authorization]:
        """Namespace-scoped policies of ``namespace`` (``""`` gives the global ones)."""
        return self._by_namespace.get(namespace, {})

    def for_workload(self, namespace: str, workload_policies: tuple[str, ...]) -> list[Authorization]:
        """Policies that apply to a workload: its namespace's, the global ones, and those it names.

        A named policy not (yet) known is skipped, as upstream does while the control plane catches up.
        """
        out = list(self._by_namespace.get(namespace, {}).values())
        if namespace:
            out.extend(self._by_namespace.get("", {}).values())
        for key in workload_policies:
            p = self.by_key.get(key)
            if p is not None:
                out.append(p)
        return out

    def plan(self, namespace: str, workload_policies: tuple[str, ...]) -> Plan:
        """The compiled evaluation plan for a workload (cached until the next policy change)."""
        key = (namespace, workload_policies)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 10_000:
                self._plans.clear()
            plan = self._plans[key] = Plan(self.for_workload(namespace, workload_policies))
        return plan

    def insert(self, policy: Authorization) -> Authorization | None:
        old = self.remove(policy.key)
        self._plans.clear()
        self.by_key[policy.key] = policy
        index = self._index_namespace(policy)
        if index is not None:
            self._by_namespace.setdefault(index, {})[policy.key] = policy
        return old

    def remove(self, key: str) -> Authorization | None:
        old = self.by_key.pop(key, None)
        if old is None:
            return None
        self._plans.clear()
        index = self._index_namespace(old)
        if index is not None:
            bucket = self._by_namespace.get(index)
            if bucket is not None:
                bucket.pop(key, None)
                if not bucket:
                    del self._by_namespace[index]
        return old

    @staticmethod
    def _index_namespace(policy: Authorization) -> str | None:
        if policy.scope is Scope.GLOBAL:
            return ""
        if policy.scope is Scope.NAMESPACE:
            return policy.namespace
        return None
