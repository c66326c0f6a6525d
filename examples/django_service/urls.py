from django.urls import path

from examples.django_service.shop import views

urlpatterns = [
    path("customers", views.create_customer),
    path("orders", views.place_order),
]
