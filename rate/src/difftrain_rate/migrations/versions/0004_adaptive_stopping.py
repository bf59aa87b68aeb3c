"""Adaptive stopping: a batch's stopping confidence and least raters (NULL: a batch of fixed R, as before), and
whether an item's answers settle it.

Revision ID: 0004
Revises: 0003
"""

from alembic import op
import sqlalchemy as sa


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.add_column(sa.Column('min_raters', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('stop_confidence', sa.Float(), nullable=True))
    with op.batch_alter_table('items', schema=None) as batch_op:
        batch_op.add_column(sa.Column('settled', sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table('items', schema=None) as batch_op:
        batch_op.drop_column('settled')
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.drop_column('stop_confidence')
        batch_op.drop_column('min_raters')
