"""Alembic's environment for the rating database (run by ``difftrain_rate.db.upgrade``)."""

from alembic import context
from sqlalchemy import engine_from_config, pool

from difftrain_rate.db import Base

config = context.config
connectable = engine_from_config(config.get_section(config.config_ini_section, {}), prefix="sqlalchemy.",
                                 poolclass=pool.NullPool)
with connectable.connect() as connection:
    # render_as_batch: SQLite alters a table by copying it, which batch mode does for later revisions.
    context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()
