"""API tokens get an expiry and a scope. Tokens made before expiry existed are
given the default lifetime counted from today, so no script stops at once."""

from datetime import timedelta

from django.conf import settings
from django.db import migrations, models
from django.utils import timezone


def expire_existing(apps, schema_editor):
    ApiToken = apps.get_model("portal", "ApiToken")
    ApiToken.objects.filter(expires_at__isnull=True).update(
        expires_at=timezone.now() + timedelta(days=settings.QM_TOKEN_DEFAULT_DAYS)
    )


class Migration(migrations.Migration):
    dependencies = [("portal", "0001_initial")]

    operations = [
        migrations.AddField(
            model_name="apitoken",
            name="expires_at",
            field=models.DateTimeField(null=True),
        ),
        migrations.RunPython(expire_existing, migrations.RunPython.noop),
        migrations.AlterField(
            model_name="apitoken",
            name="expires_at",
            field=models.DateTimeField(),
        ),
        migrations.AddField(
            model_name="apitoken",
            name="scope",
            field=models.CharField(
                choices=[("full", "read and write"), ("read", "read only")],
                default="full",
                max_length=8,
            ),
        ),
    ]
