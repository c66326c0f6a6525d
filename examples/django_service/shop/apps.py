from django.apps import AppConfig


class ShopConfig(AppConfig):
    name = "examples.django_service.shop"
    label = "shop"
