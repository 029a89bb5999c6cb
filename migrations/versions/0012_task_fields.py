"""The task fields a job's runner does not honour, per task (docs/SPEC.md §15).

`job_task_fields` (job, task, field, reason): each field of a job's task that its runner
warned about — ignored, recorded and never enforced, or not honoured here — with why, as
the run that queued the task found it. Kept out of the job's configuration, so it is never
compared when the job resumes.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "job_task_fields",
        sa.Column("job", sa.Text, sa.ForeignKey("jobs.name"), nullable=False),
        sa.Column("task", sa.Text, nullable=False),
        sa.Column("field", sa.Text, nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.PrimaryKeyConstraint("job", "task", "field"),
    )


def downgrade() -> None:
    op.drop_table("job_task_fields")
