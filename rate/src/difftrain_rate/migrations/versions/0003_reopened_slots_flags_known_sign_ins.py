"""Slots that count toward R (a skip or a flagged rater's answer reopens its slot), the rater's flag kept current,
and the (user, address) pairs that have signed in (exempt from other people's failures).

Revision ID: 0003
Revises: 0002
"""

from alembic import op
import sqlalchemy as sa


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('assignments', schema=None) as batch_op:
        batch_op.add_column(sa.Column('counts', sa.Boolean(), nullable=False, server_default=sa.true()))
    with op.batch_alter_table('users', schema=None) as batch_op:
        batch_op.add_column(sa.Column('flagged', sa.Boolean(), nullable=False, server_default=sa.false()))
    op.create_table('known_sign_ins',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('user_id', sa.Integer(), nullable=False),
    sa.Column('address', sa.String(length=64), nullable=False),
    sa.Column('at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], ),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('user_id', 'address', name='uq_known_sign_in')
    )
    # Answers already skipped give their slots back.
    op.execute("UPDATE assignments SET counts = false WHERE id IN "
               "(SELECT assignment_id FROM answers WHERE outcome = 'skip')")


def downgrade() -> None:
    op.drop_table('known_sign_ins')
    with op.batch_alter_table('users', schema=None) as batch_op:
        batch_op.drop_column('flagged')
    with op.batch_alter_table('assignments', schema=None) as batch_op:
        batch_op.drop_column('counts')
