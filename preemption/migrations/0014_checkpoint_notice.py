
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('preemption', '0013_attempt_preemption_risk'),
    ]

    operations = [
        migrations.AddField(
            model_name='preemptionevent',
            name='notice_committed_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='preemptionevent',
            name='notice_deadline',
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='preemptionevent',
            name='notice_sent_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AlterField(
            model_name='attempt',
            name='action',
            field=models.CharField(blank=True, choices=[('', 'None'), ('launch', 'Launch'), ('notice', 'Checkpoint notice'), ('signal', 'Signal'), ('kill', 'Kill'), ('forget', 'Forget')], max_length=8),
        ),
    ]
