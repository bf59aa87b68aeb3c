"""An index of open assignments by age: releasing stale ones reads only the open ones.

Revision ID: 0002
Revises: 0001
"""

from alembic import op


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('assignments', schema=None) as batch_op:
        batch_op.create_index('ix_assignments_open', ['answered', 'created_at'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('assignments', schema=None) as batch_op:
        batch_op.drop_index('ix_assignments_open')

