# Trap events now belong to preemption (see preemption 0003): telemetry forgets
# the model without touching the table, which preemption has taken over.

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('telemetry', '0002_simulationrun'),
        ('preemption', '0006_trapevent_from_telemetry'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.DeleteModel(name='TrapEvent')],
            database_operations=[],
        ),
    ]
