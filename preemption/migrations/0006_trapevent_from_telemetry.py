# Trap events move from telemetry to preemption, next to the jobs that write
# them. The table and its rows stay: this migration only takes the model into
# preemption's state on the existing table, then renames the table and index.

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('preemption', '0005_preemption_reason_shutdown'),
        ('telemetry', '0002_simulationrun'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name='TrapEvent',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('attempt', models.PositiveIntegerField()),
                        ('rank', models.PositiveIntegerField()),
                        ('event', models.CharField(max_length=32)),
                        ('at', models.FloatField()),
                        ('step', models.PositiveIntegerField(blank=True, null=True)),
                        ('payload', models.JSONField()),
                        ('fingerprint', models.CharField(max_length=64, unique=True)),
                        ('source', models.CharField(choices=[('post', 'POST'), ('log', 'log')], max_length=8)),
                        ('received_at', models.DateTimeField(auto_now_add=True)),
                        ('job', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='trap_events', to='preemption.job')),
                    ],
                    options={
                        'ordering': ['at', 'id'],
                        'indexes': [models.Index(fields=['job', 'attempt', 'event'], name='telemetry_t_job_id_2991b1_idx')],
                        'db_table': 'telemetry_trapevent',
                    },
                ),
            ],
            database_operations=[],
        ),
        migrations.AlterModelTable(name='trapevent', table=None),
        migrations.RenameIndex(
            model_name='trapevent',
            new_name='preemption__job_id_65f6a7_idx',
            old_name='telemetry_t_job_id_2991b1_idx',
        ),
    ]
