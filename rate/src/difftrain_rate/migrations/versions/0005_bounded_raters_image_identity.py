"""R bounded to 1..100 by a CHECK constraint (rows above are clamped to 100, their least raters with them); each
image's inode and size as imported (read from the files at the upgrade; NULL for a file gone by then, which the
image server then refuses).

Revision ID: 0005
Revises: 0004
"""

import logging
import os

from alembic import op
import sqlalchemy as sa


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None

MAX_RATERS = 100


def upgrade() -> None:
    conn = op.get_bind()
    # Clamped, not refused: R above 100 is never what was meant (from R = 2^30, 2R overflowed int4 and no rater was
    # served); a batch at 100 rates on. R below 1 could never be stored (the earlier check).
    clamped = conn.execute(sa.text("SELECT name, raters FROM batches WHERE raters > :most"), {"most": MAX_RATERS}).all()
    conn.execute(sa.text("UPDATE batches SET raters = :most WHERE raters > :most"), {"most": MAX_RATERS})
    conn.execute(sa.text("UPDATE batches SET min_raters = raters WHERE min_raters > raters"))
    for name, raters in clamped:
        logging.getLogger("alembic.runtime.migration").warning("batch %r: raters %s clamped to %s", name, raters,
                                                               MAX_RATERS)
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.drop_constraint('ck_batches_raters', type_='check')
        batch_op.create_check_constraint('ck_batches_raters', f'raters >= 1 AND raters <= {MAX_RATERS}')
    with op.batch_alter_table('images', schema=None) as batch_op:
        batch_op.add_column(sa.Column('inode', sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column('size', sa.BigInteger(), nullable=True))
    images = sa.table('images', sa.column('id', sa.String), sa.column('path', sa.Text),
                      sa.column('inode', sa.BigInteger), sa.column('size', sa.BigInteger))
    for image_id, path in conn.execute(sa.select(images.c.id, images.c.path)).all():
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            continue
        if os.path.isfile(path) and not os.path.islink(path):
            conn.execute(sa.update(images).where(images.c.id == image_id).values(inode=st.st_ino, size=st.st_size))


def downgrade() -> None:
    with op.batch_alter_table('images', schema=None) as batch_op:
        batch_op.drop_column('size')
        batch_op.drop_column('inode')
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.drop_constraint('ck_batches_raters', type_='check')
        batch_op.create_check_constraint('ck_batches_raters', 'raters >= 1')
