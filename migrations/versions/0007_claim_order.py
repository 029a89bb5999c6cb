"""The job queue's claim index follows the claim order: queued trials k-major (every
task's first trial before any task's second), so a claim is an index scan that stops at
the first row instead of sorting the whole queue (docs/SPEC.md §13; bench/jobs.py).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30
"""

from __future__ import annotations

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index("job_queue_claim", "job_queue")
    op.create_index("job_queue_claim", "job_queue", ["job", "state", "k_index", "task"])


def downgrade() -> None:
    op.drop_index("job_queue_claim", "job_queue")
    op.create_index("job_queue_claim", "job_queue", ["job", "state", "task", "k_index"])
